"""`TrainSettings`: everything the training loop needs besides the model and the data, validated."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

SCHEDULES = ("constant", "cosine", "polynomial", "wsd")
MIXED_PRECISION = ("no", "bf16", "fp16")


@dataclass(frozen=True)
class TrainSettings:
    """Everything the loop needs besides the model and the data. Steps count optimizer updates.

    lr: peak learning rate of AdamW; warmup: linear warm-up steps from 0; schedule: "cosine" (decays to
    min_lr_ratio * lr at the last step), "polynomial" (power 1, as transformers' default polynomial schedule: a
    straight line from lr to min_lr_ratio * lr at the last step), "constant", or "wsd" (warm-up, stable, decay:
    constant, then a cosine to min_lr_ratio * lr over the last WSD_DECAY of the steps); batch_size: micro-batch size per
    process (informational for the loop, used by stream builders); grad_accum: micro-batches per update; clip: max
    global gradient norm (0 = no clipping); mixed_precision: "no" | "bf16" | "fp16"; grad_checkpointing: recompute
    activations in backward; eval_every / checkpoint_every: in steps (0 = only at the end / never during the run);
    keep_last: checkpoints kept; log_every: steps between metric lines; seed: seeds torch, numpy and random before
    the model's forward passes.
    """

    steps: int = 1000
    lr: float = 1e-3
    warmup: int = 100
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    batch_size: int = 32
    grad_accum: int = 1
    clip: float = 1.0
    mixed_precision: str = "no"
    grad_checkpointing: bool = False
    eval_every: int = 0
    checkpoint_every: int = 0
    keep_last: int = 2
    log_every: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        for name in ("steps", "batch_size", "grad_accum", "log_every", "keep_last"):
            check_int(name, getattr(self, name), 1)
        for name in ("warmup", "eval_every", "checkpoint_every", "seed"):
            check_int(name, getattr(self, name), 0)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not allowed; choose one of: {', '.join(SCHEDULES)}")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(
                f"mixed_precision={self.mixed_precision!r} is not allowed; choose one of: {', '.join(MIXED_PRECISION)}"
            )
        for name, low, high in (
            ("lr", 0.0, 10.0),
            ("min_lr_ratio", 0.0, 1.0),
            ("weight_decay", 0.0, 10.0),
            ("clip", 0.0, 1e9),
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"{name}={value!r} is not allowed; it must be a number in [{low}, {high}]")
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr!r} is not allowed; it must be positive")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas={self.betas!r} is not allowed; it must be two numbers in [0, 1)")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["betas"] = list(self.betas)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown training setting '{unknown[0]}'; choose from: {', '.join(sorted(known))}")
        return cls(**data)


def check_int(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name}={value!r} is not allowed; it must be an integer >= {low}")
