"""The comparisons tapelm owes its users (the issues "Comparisons that learn" and "Ablations, faithful baselines"):
per task, the rows (encodings, or TAPE's variants) and how many seeds each needs at the default preset's recipe, or
at a design of the task given as options over it (addition with index hints), and the same at GPU scale. The plan is
data, docs/plans.json (`OWED`, `AT_GPU_SCALE` are read from it).
`tapelm report` writes which are complete into docs/RESULTS.md, with the command that runs what is missing; since
finished runs are cached, and archived by the report (`--archive`), that command continues a comparison across
sessions and machines."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from .presets import DEFAULT_PRESET
from .runs import RunSpec, option_flags, settings_hash

PLAN_FILE = Path(__file__).resolve().parents[3] / "docs" / "plans.json"
GPU = "gpu"


def default_settings_hash(task: str) -> str:
    """The comparison folder's name at the default preset (where `tapelm compare TASK` writes; every encoding of a
    comparison shares it)."""
    return settings_hash(RunSpec(task=task, pe="tape"))


def superseded_by(task: str, preset: str, settings_hash: str) -> str | None:
    """The default preset's current settings hash for `task` when a comparison of that preset at `settings_hash` was
    run at other settings (an older recipe, or options given on the command line) than the preset's or an owed
    design's (see OWED); None otherwise."""
    if preset != DEFAULT_PRESET:
        return None
    current = default_settings_hash(task)
    owed = {owed.settings_hash() for owed in OWED if owed.task == task}
    return None if settings_hash in owed | {current} else current


@dataclass(frozen=True)
class OwedComparison:
    task: str
    rows: tuple[str, ...]
    seeds: int  # seeds 0 .. seeds-1 of every row
    label: str
    ablation: bool = False
    task_options: tuple[tuple[str, object], ...] = ()  # over the preset's (a design of the task)
    train_options: tuple[tuple[str, object], ...] = ()  # over the preset's (that design's recipe)
    preset: str = DEFAULT_PRESET

    def spec(self) -> RunSpec:
        return RunSpec(
            task=self.task,
            pe="tape",
            preset=self.preset,
            task_options=dict(self.task_options),
            train_options=dict(self.train_options),
        )

    def settings_hash(self) -> str:
        return settings_hash(self.spec())

    def missing(self, finished: dict[str, set[int]]) -> dict[str, int]:
        """The rows that lack some of seeds 0 .. seeds-1, each with how many of them it has."""
        owed = set(range(self.seeds))
        have = {row: len(owed & finished.get(row, set())) for row in self.rows}
        return {row: count for row, count in have.items() if count < self.seeds}

    def command(self, rows: list[str], archive: str | None = None) -> str:
        """The command that runs `rows` on every owed seed (and reuses what is cached, or archived in `archive`)."""
        selection = ["ablate", self.task, "--variants"] if self.ablation else ["compare", self.task, "--pe"]
        return shlex.join(
            [
                "tapelm",
                *selection,
                *rows,
                "--seeds",
                *map(str, range(self.seeds)),
                *option_flags(self.spec()),
                *(["--archive", archive] if archive else []),
            ]
        )


def load_plan(path: Path = PLAN_FILE) -> dict[str, tuple[OwedComparison, ...]]:
    """docs/plans.json's comparisons: "laptop" at the default preset, "gpu" at the gpu preset, in the file's order."""
    data = json.loads(path.read_text())

    def comparison(entry: dict, preset: str) -> OwedComparison:
        rows = entry["rows"]
        return OwedComparison(
            task=entry["task"],
            rows=tuple(data["groups"][rows] if isinstance(rows, str) else rows),
            seeds=entry["seeds"],
            label=entry["label"],
            ablation=entry.get("ablation", False),
            task_options=tuple(entry.get("task_options", {}).items()),
            train_options=tuple(entry.get("train_options", {}).items()),
            preset=preset,
        )

    return {
        scale: tuple(comparison(entry, preset) for entry in data[scale]["comparisons"])
        for scale, preset in (("laptop", DEFAULT_PRESET), ("gpu", GPU))
    }


_PLAN = load_plan()
OWED = _PLAN["laptop"]
AT_GPU_SCALE = _PLAN["gpu"]


def at_laptop_scale(owed: OwedComparison) -> OwedComparison:
    """The laptop comparison (default preset) of a comparison's task and design: the one its recipe scales."""
    return next(o for o in OWED if (o.task, o.task_options, o.ablation) == (owed.task, owed.task_options, False))


__all__ = [
    "AT_GPU_SCALE",
    "GPU",
    "OWED",
    "OwedComparison",
    "at_laptop_scale",
    "default_settings_hash",
    "load_plan",
]
