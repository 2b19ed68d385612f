"""Across-seed statistics of a comparison: means with t-based 95% confidence intervals, differences paired by seed
(two runs with the same seed saw the same training data stream and the same test set), and the sampling error of
the evaluation itself, so that the seed spread and the test-set noise can be told apart."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from scipy import stats

CONFIDENCE = 0.95


def _finite(values: Sequence[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and not math.isnan(v)]


def interval(values: Sequence[float | None], confidence: float = CONFIDENCE) -> dict[str, float]:
    """mean, sample std, n and the half-width of the t confidence interval of the mean (nan with one value)."""
    values = _finite(values)
    n = len(values)
    if n == 0:
        return {"mean": float("nan"), "std": float("nan"), "n": 0, "half_width": float("nan")}
    mean = float(np.mean(values))
    if n == 1:
        return {"mean": mean, "std": 0.0, "n": 1, "half_width": float("nan")}
    std = float(np.std(values, ddof=1))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1) * std / math.sqrt(n))
    return {"mean": mean, "std": std, "n": n, "half_width": half}


def paired_difference(
    first: Mapping[int, float], second: Mapping[int, float], confidence: float = CONFIDENCE
) -> dict[str, float]:
    """first - second over the seeds both have: the interval of the mean difference, and the seeds used."""
    seeds = sorted(set(first) & set(second))
    result = interval([first[s] - second[s] for s in seeds], confidence)
    result["seeds"] = seeds
    return result


def higher_is_better(metric: str) -> bool:
    """Whether a larger value of `metric` is better: every metric tapelm reports but perplexity."""
    return metric != "perplexity"


def verdict(difference: Mapping[str, float], higher_is_better: bool = True) -> str:
    """'better' / 'worse' when the interval of the paired difference excludes zero (in the direction where higher is
    better), else 'no difference shown'; 'too few seeds' under two pairs."""
    if difference["n"] < 2 or math.isnan(difference["half_width"]):
        return "too few seeds"
    gain = difference["mean"] if higher_is_better else -difference["mean"]
    if gain - difference["half_width"] > 0:
        return "better"
    if gain + difference["half_width"] < 0:
        return "worse"
    return "no difference shown"


def format_difference(difference: Mapping[str, float], log_ratio: bool = False) -> str:
    """A paired difference with its 95% interval: points (± half-width) for accuracies, or a ratio [low, high] for
    differences of logarithms (perplexities)."""
    mean, half, n = difference["mean"], difference["half_width"], difference["n"]
    if log_ratio:
        text = f"×{math.exp(mean):.3f}"
        return text if n < 2 else text + f" [{math.exp(mean - half):.3f}, {math.exp(mean + half):.3f}]"
    text = f"{mean * 100:+.1f}"
    return text if n < 2 else text + f" ± {half * 100:.1f}"


def proportion_error(proportion: float, examples: int) -> float:
    """The standard error of an accuracy measured on `examples` independent examples."""
    if examples <= 0 or math.isnan(proportion):
        return float("nan")
    return math.sqrt(max(proportion * (1 - proportion), 0.0) / examples)


__all__ = [
    "CONFIDENCE",
    "interval",
    "paired_difference",
    "higher_is_better",
    "verdict",
    "format_difference",
    "proportion_error",
]
