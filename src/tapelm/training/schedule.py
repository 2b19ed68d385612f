"""The learning-rate schedules: linear warm-up, then constant, cosine, polynomial or warm-up-stable-decay."""

from __future__ import annotations

import math
from collections.abc import Callable

from .settings import TrainSettings

WSD_DECAY = 0.2  # the share of the steps over which "wsd" decays


def learning_rate_lambda(settings: TrainSettings) -> Callable[[int], float]:
    """The multiplier of the peak learning rate after `step` updates: linear warm-up, then constant, cosine,
    polynomial (linear) decay, or constant followed by a cosine over the last WSD_DECAY of the steps ("wsd")."""

    def factor(step: int) -> float:
        if step < settings.warmup:
            return (step + 1) / (settings.warmup + 1)
        if settings.schedule == "constant":
            return 1.0
        start = settings.warmup
        if settings.schedule == "wsd":
            start = max(start, settings.steps - round(WSD_DECAY * settings.steps))
            if step < start:
                return 1.0
        span = max(1, settings.steps - start)
        progress = min(1.0, (step - start) / span)
        if settings.schedule == "polynomial":
            return settings.min_lr_ratio + (1 - settings.min_lr_ratio) * (1 - progress)
        return settings.min_lr_ratio + (1 - settings.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
