"""The compute ladder (issue 63): rungs from a task's laptop recipe toward its GPU recipe along one rule, each a
TAPE/RoPE comparison like any other, and the trend of their paired difference against compute, extrapolated to the
GPU recipe before a GPU runs it.

The rule (docs/RECIPES.md, "The compute ladder"), tokens first: a rung sits at t in [0, 1] on the log scale of compute
from the laptop recipe (t = 0, preset cpu-small) to the GPU recipe (t = 1, preset gpu), where compute is width squared
times tokens trained. Compute goes first into tokens: batch and steps grow geometrically toward the GPU recipe's until
the rung trains as many tokens as the GPU recipe, and only then does the model grow, heads, head width, MLP width and
the learning rate geometrically toward the GPU recipe's. Rounding: head width to multiples of 4, MLP width to
multiples of 8, steps to multiples of 50; the warm-up and evaluation interval keep their share of the steps. Depth,
task options and test sets are the laptop's (they are the GPU recipe's too); rungs train in float32 on the CPU. A rung
named "k x" sits at t = log k / log(the GPU recipe's compute over the laptop's); the ladder reports the factor of
RoPE's training FLOPs that the rounded recipe has. Why tokens first: MQAR's RoPE stays on the task's plateau at every
width from 176 up on the CPU's batches, while the laptop's width learns (docs/RECIPES.md)."""

from __future__ import annotations

import datetime
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from ..analysis.statistics import format_difference, interval
from ..training.atomic import write_json_atomically
from ..training.launchers import Log
from ..training.provenance import environment
from . import claims
from .archive import archived_comparisons
from .budget import training_flops
from .compare import COMPARISON_FILE, aggregate, compare
from .presets import DEFAULT_PRESET, get_preset
from .runs import RunSpec, resolve

logger = logging.getLogger(__name__)

GPU_PRESET = "gpu"
LADDER_TASKS = ("mqar", "text", "passkey")  # tasks with a GPU recipe of their own, in the order the issue asks
REFERENCE, SUBJECT = "rope", "tape"


def _geometric(low: float, high: float, t: float) -> float:
    return low * (high / low) ** t


def _multiple(value: float, of: int) -> int:
    return max(of, of * round(value / of))


def _growth(task: str) -> tuple[float, float]:
    """How much `task`'s GPU recipe grows the laptop's tokens trained and its width squared."""
    laptop, gpu = get_preset(DEFAULT_PRESET, task), get_preset(GPU_PRESET, task)
    tokens = (gpu.train.batch_size * gpu.train.steps) / (laptop.train.batch_size * laptop.train.steps)
    return tokens, (gpu.model.hidden_size / laptop.model.hidden_size) ** 2


def rung_spec(task: str, t: float, pe: str = REFERENCE, seed: int = 0) -> RunSpec:
    """The run of `pe` at place `t` of `task`'s ladder (the laptop recipe at 0, the GPU recipe's sizes at 1)."""
    if task not in LADDER_TASKS:
        raise ValueError(f"task {task!r} has no ladder; choose one of: {', '.join(LADDER_TASKS)}")
    if not 0 <= t <= 1:
        raise ValueError(f"t={t!r} is not allowed; a rung lies between the laptop (0) and the GPU recipe (1)")
    laptop, gpu = get_preset(DEFAULT_PRESET, task), get_preset(GPU_PRESET, task)
    small, large = laptop.model, gpu.model
    tokens, width = _growth(task)
    scale = t * math.log(tokens * width)
    data = min(1.0, scale / math.log(tokens))  # the place along the tokens' growth
    size = max(0.0, (scale - math.log(tokens)) / math.log(width))  # the place along the model's growth
    heads = round(_geometric(small.num_attention_heads, large.num_attention_heads, size))
    head_width = _multiple(
        _geometric(small.hidden_size / small.num_attention_heads, large.hidden_size / large.num_attention_heads, size),
        4,
    )
    steps = _multiple(_geometric(laptop.train.steps, gpu.train.steps, data), 50)
    share = steps / laptop.train.steps
    model = {
        "hidden_size": heads * head_width,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "intermediate_size": _multiple(_geometric(small.intermediate_size, large.intermediate_size, size), 8),
    }
    train = {
        "steps": steps,
        "batch_size": round(_geometric(laptop.train.batch_size, gpu.train.batch_size, data)),
        "lr": float(f"{_geometric(laptop.train.lr, gpu.train.lr, size):.3g}"),
        "warmup": round(laptop.train.warmup * share),
        "eval_every": max(1, round(laptop.train.eval_every * share)),
    }
    if t == 0:  # the laptop recipe itself, whose comparison is archived under its own hash
        model, train = {}, {}
    return RunSpec(task, pe, seed, DEFAULT_PRESET, model_options=model, train_options=train)


def compute(spec: RunSpec) -> float:
    """RoPE's training FLOPs at `spec`'s recipe (the ladder's x axis)."""
    return training_flops(resolve(replace(spec, pe=REFERENCE, seed=0)))


def place_of(task: str, factor: float) -> float:
    """The t at which `task`'s ladder has `factor` times the laptop's compute (width squared times tokens trained,
    before any rounding): t = log(factor) / log(that compute at the GPU recipe)."""
    top = math.prod(_growth(task))
    if not 1 <= factor <= top:
        raise ValueError(
            f"factor={factor!r} is not allowed; {task}'s ladder runs from 1x to its GPU recipe's {top:.0f}x"
        )
    return round(math.log(factor) / math.log(top), 4)


@dataclass(frozen=True)
class Rung:
    """One rung: its nominal factor, its place t, the comparison's base spec (RoPE, seed 0) and its real factor."""

    nominal: float
    t: float
    spec: RunSpec
    factor: float


def rungs(task: str, factors: Sequence[float]) -> list[Rung]:
    """The rungs of `task` at the nominal compute `factors` (1 is the laptop recipe), validated before any work."""
    base = compute(rung_spec(task, 0.0))
    found = []
    for nominal in factors:
        t = 0.0 if nominal == 1 else place_of(task, nominal)
        spec = rung_spec(task, t)
        found.append(Rung(nominal, t, spec, compute(spec) / base))
    return found


def trend(points: Sequence[tuple[float, Mapping[int, float]]], at: float, confidence: float = 0.95) -> dict[str, Any]:
    """The least-squares line of the paired difference (one value per seed at each compute) against log10(compute),
    and its value at compute `at` with the t interval of that mean (n - 2 degrees of freedom)."""
    xs = np.array([math.log10(c) for c, by_seed in points for _ in by_seed], dtype=float)
    ys = np.array([v for _, by_seed in points for v in by_seed.values()], dtype=float)
    if len(set(xs.tolist())) < 2 or len(xs) < 3:
        raise ValueError("a trend needs differences at two computes or more, three values in all")
    slope, intercept = np.polyfit(xs, ys, 1)
    residual = ys - (slope * xs + intercept)
    dof = len(xs) - 2
    scale = math.sqrt(float(residual @ residual) / dof) if dof else float("nan")
    x0 = math.log10(at)
    spread = float(((xs - xs.mean()) ** 2).sum())
    error = scale * math.sqrt(1 / len(xs) + (x0 - xs.mean()) ** 2 / spread)
    half = float(stats.t.ppf(0.5 + confidence / 2, dof) * error) if dof else float("nan")
    mean = float(slope * x0 + intercept)
    return {
        "slope_per_decade": float(slope),
        "intercept": float(intercept),
        "at": at,
        "mean": mean,
        "half_width": half,
        "low": mean - half,
        "high": mean + half,
        "points": len(xs),
    }


def rung_differences(summary: Mapping[str, Any]) -> dict[int, float]:
    """TAPE minus RoPE beyond the training length, per seed both have, from a comparison's summary (`aggregate`)."""
    rows = summary["rows"]
    if SUBJECT not in rows or REFERENCE not in rows:
        return {}
    tape, rope = rows[SUBJECT]["per_seed"]["longer"], rows[REFERENCE]["per_seed"]["longer"]
    return {int(seed): tape[seed] - rope[seed] for seed in sorted(set(tape) & set(rope))}


def climb(
    task: str,
    factors: Sequence[float],
    seeds: Sequence[int],
    root: str | Path = "runs",
    archive: str | Path | None = None,
    launcher=None,
    log: Log | None = None,
) -> list[dict[str, Any]]:
    """Run (or reuse) TAPE and RoPE at each rung, cheapest first, as comparisons like any other (resumable, archived
    by `tapelm report`); `log` gets each rung's paired difference beyond the training length as it lands. Every rung
    is validated before the first trains."""
    say = log or logger.info
    found = []
    for rung in sorted(rungs(task, factors), key=lambda r: r.factor):
        say(f"rung {rung.nominal:g}x of {task} (t = {rung.t}, {rung.factor:.2f}x the laptop's training FLOPs)")
        summary = compare(
            rung.spec, [SUBJECT, REFERENCE], list(seeds), root=root, archive=archive, launcher=launcher, log=say
        )
        differences = rung_differences(summary)
        rows = summary["rows"]
        learned = {
            pe: claims.learned(task, summary["metric"], rows[pe]["in_distribution"]["mean"])
            for pe in (SUBJECT, REFERENCE)
            if pe in rows
        }
        say(
            f"rung {rung.nominal:g}x of {task}: TAPE - RoPE beyond the training length "
            f"{format_difference(interval(list(differences.values())))} points"
            + (
                ""
                if all(learned.values())
                else f" (not learned in distribution: {[pe for pe, ok in learned.items() if not ok]})"
            )
        )
        found.append(
            {
                "nominal": rung.nominal,
                "t": rung.t,
                "factor": rung.factor,
                "compute": compute(rung.spec),
                "settings_hash": summary["settings_hash"],
                "learned": learned,
                "differences": differences,
            }
        )
    return found


def gpu_compute(task: str) -> float:
    """RoPE's training FLOPs at `task`'s GPU recipe: where the trend is read."""
    return training_flops(resolve(RunSpec(task, REFERENCE, 0, GPU_PRESET)))


def write_prediction(task: str, climbed: list[dict[str, Any]], folder: str | Path) -> Path:
    """Fit the rungs' trend, read it at the GPU recipe's compute and write it, dated, with the commit, to
    FOLDER/<task>.json, once: a prediction is written before its GPU rung runs and never replaced (delete the
    file to predict anew). Refuses rungs that did not learn in distribution."""
    path = Path(folder) / f"{task}.json"
    if path.exists():
        raise ValueError(f"{path} holds a prediction already; a prediction is written once (delete it to predict anew)")
    unlearned = [f"{r['nominal']:g}x {pe}" for r in climbed for pe, ok in r["learned"].items() if not ok]
    if unlearned:
        raise ValueError(f"a rung that did not learn in distribution cannot be compared: {', '.join(unlearned)}")
    target = gpu_compute(task)
    prediction = trend([(r["compute"], r["differences"]) for r in climbed], target)
    record = {
        "task": task,
        "date": datetime.date.today().isoformat(),
        "commit": environment()["commit"],
        "rule": "experiments/ladder.py",
        "rungs": climbed,
        "gpu_preset": GPU_PRESET,
        "prediction": prediction,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomically(path, record)
    return path


def gpu_differences(comparisons: str | Path, task: str) -> dict[int, float]:
    """TAPE - RoPE beyond the training length per seed in the archived GPU comparison of `task` at the GPU preset's own
    recipe (`tapelm stage`'s) with the most such seeds (empty when none has both)."""
    own = json.loads(json.dumps(get_preset(GPU_PRESET, task).task_options))
    found: dict[int, float] = {}
    for directory in archived_comparisons(comparisons, task):
        record = json.loads((directory / COMPARISON_FILE).read_text())
        if record.get("preset") != GPU_PRESET or record.get("task_options") != own:
            continue
        differences = rung_differences(aggregate(directory, write=False))
        if len(differences) > len(found):
            found = differences
    return found


def backtest(climbed: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The evidence that the trend predicts anything: the line fitted on every CPU rung but the highest, read at the
    highest's compute and scored against what that rung measured (the mean over its seeds): {"held_out": its nominal
    factor, "prediction": `trend`'s, "observed", "error": observed - predicted, "scored"}; None with fewer than two
    lower rungs of differences."""
    ordered = sorted(climbed, key=lambda rung: rung["compute"])
    lower, highest = ordered[:-1], ordered[-1] if ordered else None
    if len([r for r in lower if r["differences"]]) < 2 or not highest["differences"]:
        return None
    prediction = trend([(r["compute"], r["differences"]) for r in lower], highest["compute"])
    observed = float(np.mean(list(highest["differences"].values())))
    return {
        "held_out": highest["nominal"],
        "prediction": prediction,
        "observed": observed,
        "error": observed - prediction["mean"],
        "scored": scored(prediction, observed),
    }


def scored(prediction: Mapping[str, Any], observed: float) -> str:
    """'inside' or 'outside' the predicted interval."""
    return "inside" if prediction["low"] <= observed <= prediction["high"] else "outside"


__all__ = [
    "LADDER_TASKS",
    "Rung",
    "backtest",
    "climb",
    "compute",
    "gpu_compute",
    "gpu_differences",
    "place_of",
    "rung_differences",
    "rung_spec",
    "rungs",
    "scored",
    "trend",
    "write_prediction",
]
