"""The runs of a comparison or a stage as jobs of a launcher (`tapelm.training.launchers`: local or SLURM).

Whoever launches it, a run trains in its folder of the comparison (`run_task` with resume), so a run already finished
is never launched again, a killed one resumes from its newest checkpoint, and the archive reads the same files.
Each result.json records its device and how it was launched (`launch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .runs import RunOptions, run_task


@dataclass(frozen=True)
class Job:
    """One run to launch: the resolved run, its folder and the command recorded with it."""

    run: Any
    run_dir: Path
    command: str

    def __call__(self, options: RunOptions, launch: dict[str, Any]) -> dict[str, Any] | None:
        """Train and evaluate the run (resuming from its folder); its result."""
        return run_task(self.run, self.run_dir, options, resume=True, command=self.command, launch=launch)

    def __str__(self) -> str:
        return f"{self.run.spec.pe} / seed {self.run.spec.seed}"

    @staticmethod
    def summary(result: dict[str, Any]) -> str:
        """A run's metric in a few words."""
        summary = result["summary"]
        return f"{result['metric']} in-distribution {summary['in_distribution']:.4f}, all {summary['all']:.4f}"


__all__ = ["Job"]
