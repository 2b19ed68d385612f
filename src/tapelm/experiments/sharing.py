"""Whether runs sharing one device pay (issue 63, part 5): the same short run of a task's GPU recipe trained k at once
on one device, for each k asked, and the device's training throughput at k against one run alone.

Each k trains seeds 0..k-1 of the run (the GPU recipe's model, batch and data, `steps` steps, the smallest final
evaluation the task allows) in k worker processes pinned to the device, as `tapelm stage` would train them
(`LocalLauncher(k, devices=[device])`). A run's rate is its steady one: its training FLOPs per step times the steps
between its first log after step 1 and its last, over the seconds between them (its metrics.jsonl), leaving out the
process's start, the model's build, the first steps' compiling and autotuning and the final evaluation, which a
full-length run amortises; the device's throughput at k is the sum of its k runs' rates, and `against_one` is that
over the throughput at the smallest k measured (one run alone when 1 is among them). The k runs start together and
their steady phases overlap but for the start of the slowest. `tapelm stage` prices a run that shares its GPU
(`--jobs k`) by the factors copied into docs/gpu/budget.json ("sharing"; as if alone until a visit measures them)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..training.atomic import write_json_atomically
from ..training.launchers import LocalLauncher, Log
from ..training.provenance import environment
from .budget import training_flops
from .launchers import Job
from .plan import GPU
from .runs import RunOptions, RunSpec, resolve

EVAL_N = 8  # the smallest final evaluation every task's test lengths allow (text scores n x 64 tokens, >= 512)


def sharing_spec(task: str, pe: str, steps: int) -> RunSpec:
    """The GPU recipe of `task` for `pe` (seed 0), cut to `steps` steps with no evaluation while training."""
    return RunSpec(task, pe, 0, GPU, train_options={"steps": steps, "eval_every": 0}, eval_n=EVAL_N)


def steady_rate(run_dir: Path, flops_per_step: float) -> float:
    """A finished run's training FLOPs per second between its first log after step 1 and its last (metrics.jsonl)."""
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [line for line in logged if "elapsed_s" in line and line["step"] > 1]
    if len(logged) < 2:
        raise ValueError(f"{run_dir.name}: fewer than two logs after step 1; give more steps than two log intervals")
    first, last = logged[0], logged[-1]
    return flops_per_step * (last["step"] - first["step"]) / (last["elapsed_s"] - first["elapsed_s"])


def measure_sharing(
    spec: RunSpec, counts: Sequence[int], device: str, root: str | Path, log: Log = print
) -> dict[str, Any]:
    """Train `spec` (seeds 0..k-1) k at once on `device` for each k of `counts`; the record (module docstring),
    also written to root/sharing.json. Runs already trained under `root` are kept (run_task resumes them)."""
    counts = sorted(set(counts))
    if not counts or counts[0] < 1:
        raise ValueError(f"counts={counts!r}: give numbers of runs at once, each at least 1")
    run = resolve(spec)
    if run.settings.steps < 2 * run.settings.log_every:
        raise ValueError(
            f"steps={run.settings.steps}: give at least {2 * run.settings.log_every} (two log intervals of "
            f"{run.settings.log_every} steps: the rate is measured between logs after the first step)"
        )
    root = Path(root)
    flops = training_flops(run)
    measured: dict[str, Any] = {}
    for count in counts:
        jobs = [
            Job(resolve(replace(spec, seed=seed)), root / f"{count}-at-once" / f"seed{seed}", "tapelm sharing")
            for seed in range(count)
        ]
        started = time.time()
        outcomes = list(LocalLauncher(count, devices=[device], log=log).launch(jobs, RunOptions(progress=False)))
        failed = [outcome.error for outcome in outcomes if outcome.error is not None]
        if failed:
            raise RuntimeError(f"{count} runs at once on device {device}: a run failed: {failed[0]}")
        rates = [steady_rate(job.run_dir, flops / spec.train_options["steps"]) for job in jobs]
        throughput = sum(rates)
        measured[str(count)] = {
            "run_flops_per_second": rates,
            "wall_seconds": time.time() - started,
            "flops_per_second": throughput,
            "against_one": throughput / measured[str(counts[0])]["flops_per_second"] if measured else 1.0,
        }
        log(f"{count} at once: {throughput / 1e12:.2f} TFLOP/s of training, {measured[str(count)]['against_one']:.2f}x")
    record = {
        "task": spec.task,
        "pe": spec.pe,
        "preset": spec.preset,
        "steps": spec.train_options["steps"],
        "flops_per_run": flops,
        "device": device,
        "at_once": measured,
        "environment": environment(),
    }
    write_json_atomically(root / "sharing.json", record)
    return record


__all__ = ["sharing_spec", "measure_sharing", "EVAL_N"]
