"""The command-line flags of `TrainSettings`, shared by every command that trains (`tapelm train`, `compare`,
`sweep`, `scrolls finetune`)."""

from __future__ import annotations

TRAIN_FLAGS = {  # command-line flag -> TrainSettings field
    "steps": int,
    "lr": float,
    "warmup": int,
    "schedule": str,
    "batch_size": int,
    "grad_accum": int,
    "clip": float,
    "mixed_precision": str,
    "eval_every": int,
    "checkpoint_every": int,
    "keep_last": int,
    "log_every": int,
    "weight_decay": float,
}


def add_train_flags(parser, exclude: tuple[str, ...] = (), flags: dict[str, type] | None = None) -> None:
    """One flag per TrainSettings field in `flags` (default TRAIN_FLAGS; less `exclude`), default None = the
    preset's, and --grad-checkpointing."""
    for name, kind in (flags or TRAIN_FLAGS).items():
        if name in exclude:
            continue
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=kind,
            default=None,
            help=f"training setting {name} (default: the preset's)",
        )
    parser.add_argument("--grad-checkpointing", action="store_true", default=None, help="recompute activations")


__all__ = ["TRAIN_FLAGS", "add_train_flags"]
