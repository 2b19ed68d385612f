"""What a run costs before it is timed: its training FLOPs and the seconds it is predicted to take on one GPU.

FLOPs are counted as `tapelm bench speed` counts them, on the run's own training batches: 6 per non-embedding
parameter and real token (forward and backward; the model gathers the real tokens of a padded batch before its
projections and MLP), and 6 x layers x hidden x padded width per real token for causal attention.

A prediction is made from GPU measurements only, never from the machine that makes it: the run's FLOPs times its
encoding's step time against RoPE's (`step_cost`, measured by `tapelm bench speed` on GPUs), divided by a RoPE rate
(`Rate`) measured by finished GPU runs (`archived_rates`: their FLOPs over their seconds, start to finish), or, before
any, by the bench. `tapelm stage` replaces it by the durations of finished runs as soon as there are any.

The measurements and the stage's budgets are data, with their sources: docs/gpu/budget.json (`gpu_budget`).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..positional import StepCost, encoding_class, is_registered, registered
from .runs import RESULT_FILE, ResolvedRun, batch_stream, run_from_identity

# What a stage adds to an estimate before it starts a run (building the model, CUDA's start, the final evaluation,
# saving), so that a run it starts can finish; not part of a prediction of the plan's minutes.
OVERHEAD_SECONDS = 30.0


@dataclass(frozen=True)
class Rate:
    """RoPE's training FLOPs per second on a GPU, start to finish of a run; what measured it, with which code
    (source sha256, else commit) and when (ISO time)."""

    flops_per_second: float
    source: str
    code: str = ""
    time: str = ""


BUDGET_FILE = Path(__file__).resolve().parents[3] / "docs" / "gpu" / "budget.json"


@dataclass(frozen=True)
class GpuBudget:
    """docs/gpu/budget.json: the GPU minutes the plan's prediction must fit (`minutes`, "pairs" and "plan"), a
    throughput gain no GPU has measured yet (`unmeasured_gain`: the factor and what it is), RoPE's rate from the bench
    before any GPU run is archived (`bench_rate`), and a GPU's training throughput with k runs at once against one
    run alone (`sharing`, k -> factor; `tapelm sharing`), for the k measured. Each encoding's step time against
    RoPE's is a fact of its class (`PositionalEncoding.step_cost`: `step_cost`)."""

    minutes: dict[str, float]
    unmeasured_gain: tuple[float, str]
    bench_rate: Rate
    sharing: dict[int, float]


@functools.cache
def gpu_budget() -> GpuBudget:
    """The GPU budget and measurements the repository records in docs/gpu/budget.json (read from the checkout that
    holds this source: the stage runs from one)."""
    data = json.loads(BUDGET_FILE.read_text())
    gain = data["unmeasured_gain"]
    return GpuBudget(
        minutes={part: float(data["budget_minutes"][part]) for part in ("pairs", "plan")},
        unmeasured_gain=(float(gain["gain"]), gain["what"]),
        bench_rate=Rate(float(data["bench_rate"]["flops_per_second"]), data["bench_rate"]["source"]),
        sharing={int(k): float(v) for k, v in data["sharing"]["against_one"].items()},
    )


def current_rate(rates: list[Rate]) -> Rate:
    """The rate to predict with: the slowest of those measured by the newest code (the code of the newest
    measurement), since speed belongs to code and device; the bench's (`GpuBudget.bench_rate`) when there is none."""
    if not rates:
        return gpu_budget().bench_rate
    newest = max(rates, key=lambda rate: rate.time).code
    return min((rate for rate in rates if rate.code == newest), key=lambda rate: rate.flops_per_second)


def non_embedding_parameters(run: ResolvedRun) -> int:
    """The run's parameters less its input and output embeddings."""
    with torch.device("meta"):
        model = run.build_model()
    embeddings = {
        id(p) for module in (model.get_input_embeddings(), model.get_output_embeddings()) for p in module.parameters()
    }
    return sum(p.numel() for p in model.parameters() if id(p) not in embeddings)


def _sampled(run: ResolvedRun, sample: int) -> tuple[float, int]:
    """Training FLOPs and real tokens of the first `sample` micro-batches of seed 0."""
    config, make = run.config, batch_stream(run.task, 0, run.settings.batch_size)
    weights = 6 * non_embedding_parameters(run)
    flops, tokens = 0.0, 0
    for index in range(sample):
        mask = make(index)["attention_mask"]
        real, width = int(mask.sum()), mask.shape[1]
        flops += real * (weights + 6 * config.num_hidden_layers * config.hidden_size * width)
        tokens += real
    return flops, tokens


def flops_per_micro_batch(run: ResolvedRun, sample: int = 8) -> float:
    """Training FLOPs of one micro-batch, averaged over the first `sample` micro-batches of seed 0."""
    return _sampled(run, sample)[0] / sample


def flops_per_token(run: ResolvedRun, sample: int = 8) -> float:
    """Training FLOPs per real token, over the first `sample` micro-batches of seed 0."""
    flops, tokens = _sampled(run, sample)
    return flops / tokens


def training_flops(run: ResolvedRun, sample: int = 8) -> float:
    """Training FLOPs of the whole run."""
    return flops_per_micro_batch(run, sample) * run.settings.steps * run.settings.grad_accum


def _declared_cost(pe: str) -> StepCost | None:
    return encoding_class(pe).step_cost if is_registered(pe) else None


def step_cost(pe: str) -> float:
    """An encoding's step time against RoPE's on a GPU, as its class declares it (`PositionalEncoding.step_cost`);
    the largest any encoding declares for a row without one (an encoding that declares none, a variant)."""
    declared = _declared_cost(pe)
    if declared is not None:
        return declared.ratio
    return max(cls.step_cost.ratio for cls in registered().values() if cls.step_cost is not None)


def step_cost_basis(pe: str) -> str:
    """What a row's step cost rests on: "bench" (measured on GPUs, or the largest declared for a row without one) or
    "estimated" (without a GPU: its `StepCost.source` says how)."""
    declared = _declared_cost(pe)
    return "estimated" if declared is not None and not declared.measured else "bench"


def shared_slowdown(at_once: int) -> tuple[float, str]:
    """How much longer a run takes beside `at_once - 1` others on its GPU, and what that rests on: at_once over the
    measured throughput factor (`GpuBudget.sharing`), or 1 (priced as if alone) where none is measured."""
    if at_once == 1:
        return 1.0, "alone"
    factor = gpu_budget().sharing.get(at_once)
    if factor is None:
        return 1.0, f"{at_once} per GPU, priced as alone: sharing unmeasured"
    return at_once / factor, f"{at_once} per GPU at {factor:.2f}x one run's throughput (measured)"


def predicted_seconds(run: ResolvedRun, rate: Rate | None = None) -> float:
    """A run's predicted seconds on one GPU, start to finish: its FLOPs at `rate` (default: the bench's) times its
    encoding's step cost."""
    rate = rate or gpu_budget().bench_rate
    return training_flops(run) / rate.flops_per_second * step_cost(run.spec.pe)


def measured_rate(result: dict, where: str) -> Rate:
    """The RoPE rate a finished run measured (result.json's `result`): the FLOPs of the tokens it trained this
    session, times its encoding's step cost, over its session's seconds (training and evaluation). `where` names
    the run."""
    run = run_from_identity(result["identity"])
    flops = result["tokens_this_session"] * flops_per_token(run)
    environment = result["environment"]
    return Rate(
        flops * step_cost(result["pe"]) / result["session_seconds"],
        f"{where} on {environment['device']}",
        environment.get("source_sha256") or environment.get("commit", ""),
        environment.get("time", ""),
    )


def archived_rates(archive: Path) -> list[Rate]:
    """The RoPE rate of every run under `archive` (TASK/HASH/PE/seedN/result.json) that trained on a GPU, i.e. on a
    device other than the CPU."""
    rates = []
    for path in sorted(Path(archive).glob(f"*/*/*/*/{RESULT_FILE}")):
        result = json.loads(path.read_text())
        if result.get("environment", {}).get("device", "cpu") != "cpu" and result.get("tokens_this_session"):
            rates.append(measured_rate(result, path.parent.relative_to(archive).as_posix()))
    return rates


__all__ = [
    "BUDGET_FILE",
    "GpuBudget",
    "OVERHEAD_SECONDS",
    "Rate",
    "archived_rates",
    "current_rate",
    "flops_per_micro_batch",
    "flops_per_token",
    "gpu_budget",
    "measured_rate",
    "non_embedding_parameters",
    "predicted_seconds",
    "step_cost",
    "step_cost_basis",
    "training_flops",
]
