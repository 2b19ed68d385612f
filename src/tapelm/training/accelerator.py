"""The accelerate `Accelerator` a run trains with, and the check that a launcher's processes formed one group."""

from __future__ import annotations

import os
from pathlib import Path

from . import trackers
from .settings import TrainSettings


def make_accelerator(settings: TrainSettings, report_to: tuple[str, ...] = (), run_dir: Path | None = None):
    """The Accelerator `train` uses by default (the launch environment decides DDP / FSDP / devices); with
    `report_to`, it logs to those trackers (`trackers.check_report_to`), their local logs in `run_dir`."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    def build():
        return Accelerator(
            mixed_precision=settings.mixed_precision,
            step_scheduler_with_optimizer=False,
            **trackers.accelerator_options(report_to, run_dir),
        )

    try:
        return check_world(build())
    except ValueError as error:
        if "already been initialized" not in str(error) or PartialState().num_processes > 1:
            raise
    # One process that trained before with another precision (accelerate keeps one global state): start afresh.
    AcceleratorState._reset_state()
    return check_world(build())


def check_world(accelerator):
    """ValueError when a launcher started several processes but they did not form one group (accelerate on CPU
    without ACCELERATE_USE_CPU=1 silently runs each process alone)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise ValueError(
            f"the launcher started WORLD_SIZE={launched} processes but accelerate runs "
            f"{accelerator.num_processes}; on CPU set ACCELERATE_USE_CPU=1 (with accelerate launch "
            "--multi_gpu) so that the processes form one group"
        )
    return accelerator
