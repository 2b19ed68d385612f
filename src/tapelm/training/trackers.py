"""Experiment trackers a run reports to live (`report_to`, as transformers' Trainer's), through
accelerate's trackers: the Accelerator is made with `log_with` (`accelerator_options`), `start` opens one tracker
run per training run and `train` logs its metric lines with `accelerator.log`. Trackers only watch: a run's numbers
are the same with or without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# report_to name -> (accelerate's availability check, the pip package that provides it)
TRACKERS = {
    "tensorboard": ("is_tensorboard_available", "tensorboard"),
    "wandb": ("is_wandb_available", "wandb"),
    "trackio": ("is_trackio_available", "trackio"),
    "mlflow": ("is_mlflow_available", "mlflow"),
}
PROJECT = "tapelm"
LOG_DIR = "tensorboard"  # a run folder's local tracker logs (TensorBoard's events under LOG_DIR/PROJECT)


def check_report_to(names: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """The trackers named (none for None, [] or ["none"]); ValueError naming an unknown one, or one whose package is
    not installed with the pip command that installs it, before any run starts."""
    names = [name for name in names or () if name != "none"]
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"report_to={name!r} is not allowed; choose from: {', '.join(TRACKERS)}, or none")
        check, package = TRACKERS[name]
        import accelerate.utils

        if not getattr(accelerate.utils, check)():
            raise ValueError(
                f"report_to={name!r} needs the {package} package, which is not installed: pip install {package}"
            )
    return tuple(dict.fromkeys(names))


def accelerator_options(report_to: tuple[str, ...], run_dir: Path | None) -> dict[str, Any]:
    """Keyword arguments of `Accelerator` that make it log to `report_to` (local logs under run_dir/LOG_DIR)."""
    if not report_to:
        return {}
    from accelerate.utils import ProjectConfiguration

    if run_dir is None:
        raise ValueError("reporting to trackers needs the run folder (their local logs go there)")
    return {
        "log_with": list(report_to),
        "project_config": ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(Path(run_dir) / LOG_DIR)),
    }


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested record as {"a.b": scalar}, lists and None as text: what every tracker takes as a run's config."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()}
    return {prefix[:-1]: value if isinstance(value, (bool, int, float, str)) else str(value)}


def start(accelerator, name: str, group: str, config: dict[str, Any]) -> None:
    """Open the tracker runs of `accelerator` (made with `accelerator_options`): run `name` in the project PROJECT,
    grouped by `group` (a comparison's settings hash) where the tracker groups runs, with `config` as its settings."""
    if not accelerator.log_with:
        return
    named = {
        "wandb": {"name": name, "group": group},
        "trackio": {"name": name},
        "mlflow": {"run_name": name, "tags": {"group": group}},
    }
    accelerator.init_trackers(PROJECT, config=_flat(config), init_kwargs=named)


def finish(accelerator) -> None:
    """Close the tracker runs `start` opened (flushing what they hold)."""
    for tracker in accelerator.trackers:
        tracker.finish()


def log(accelerator, prefix: str, values: dict[str, Any], step: int) -> None:
    """Send a metric line's numbers (not lists, not None) to the trackers, as prefix/key at `step`."""
    numbers = {
        f"{prefix}/{key}": value
        for key, value in values.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }
    if numbers:
        accelerator.log(numbers, step=step)


__all__ = ["TRACKERS", "accelerator_options", "check_report_to", "finish", "log", "start"]
