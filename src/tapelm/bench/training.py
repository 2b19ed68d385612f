"""`tapelm bench training`: where a preset's training step spends its time, and what the ways of making it faster
that this machine offers actually give, measured side by side in one process.

The workload is a preset's own run (model, batch, data stream; default cpu-small addition). Variants, timed
interleaved (each repetition visits every variant), medians reported as tokens per second (real, unpadded tokens)
and as ratios to the plain eager float32 step: `torch.compile` (inductor), bfloat16 autocast, and both. Beside them:
the share of a step spent making the batch, in the forward pass, in the backward pass and in the optimizer, the
padding share, and the achieved matrix-multiply rate of the step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ..experiments.provenance import environment
from ..experiments.runs import RunSpec, batch_stream, resolve

VARIANTS = {"eager fp32": (False, False), "compiled fp32": (True, False), "eager bf16 autocast": (False, True),
            "compiled bf16 autocast": (True, True)}


class Variant:
    """One way of running the same training step on its own copy of the model."""

    def __init__(self, run, compiled: bool, bf16: bool):
        self.model = run.build_model().train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=run.settings.lr)
        self.forward = torch.compile(self.model) if compiled else self.model
        self.bf16 = bf16

    def step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One step; seconds in forward, backward and the optimizer."""
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        start = time.perf_counter()
        with autocast:
            loss = self.forward(**batch).loss
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        end = time.perf_counter()
        return {"forward": forward - start, "backward": backward - forward, "optimizer": end - backward}


def measure(task: str, preset: str, steps: int, repeats: int, warmup: int, progress: bool = True) -> dict[str, Any]:
    run = resolve(RunSpec(task=task, pe="rope", preset=preset))
    make_batch = batch_stream(run.task, 0, run.settings.batch_size)
    started = time.perf_counter()
    batches = [make_batch(i) for i in range(warmup + steps)]
    data_seconds = (time.perf_counter() - started) / len(batches)
    real = [int(b["attention_mask"].sum()) for b in batches[warmup:]]
    padded = [b["input_ids"].numel() for b in batches[warmup:]]
    results: dict[str, dict[str, Any]] = {}
    for name, (compiled, bf16) in VARIANTS.items():
        torch.manual_seed(0)
        variant = Variant(run, compiled, bf16)
        started = time.perf_counter()
        for batch in batches[:warmup]:
            variant.step(batch)
        results[name] = {"variant": variant, "warmup_seconds": time.perf_counter() - started, "steps": []}
        if progress:
            print(f"{name}: warm-up {results[name]['warmup_seconds']:.1f} s", flush=True)
    for repeat in range(repeats):
        for name, entry in results.items():
            parts = [entry["variant"].step(batch) for batch in batches[warmup:]]
            entry["steps"].append({key: sum(p[key] for p in parts) for key in parts[0]})
        if progress:
            print(f"repetition {repeat + 1}/{repeats} done", flush=True)
    parameters = sum(p.numel() for p in results["eager fp32"]["variant"].model.parameters())
    report = {"task": task, "preset": preset, "steps_per_repeat": steps, "repeats": repeats,
              "batch_size": run.settings.batch_size, "parameters": parameters,
              "padding_share": 1 - sum(real) / sum(padded),
              "data_seconds_per_batch": data_seconds, "variants": {}, "environment": environment()}
    for name, entry in results.items():
        totals = [sum(s.values()) for s in entry["steps"]]
        median = statistics.median(totals)
        index = totals.index(median)
        report["variants"][name] = {
            "tokens_per_s": sum(real) / median, "seconds_per_step": median / steps,
            "share": {key: value / median for key, value in entry["steps"][index].items()},
            "warmup_seconds": entry["warmup_seconds"]}
    base = report["variants"]["eager fp32"]
    for entry in report["variants"].values():
        entry["ratio_to_eager_fp32"] = entry["tokens_per_s"] / base["tokens_per_s"]
    # 6 FLOPs per parameter and padded token (forward + backward), the attention not counted.
    report["matmul_gflops_eager_fp32"] = 6 * parameters * sum(padded) / steps / base["seconds_per_step"] / 1e9
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = [f"{report['task']} / {report['preset']}: {report['parameters'] / 1e6:.2f}M parameters, batch "
             f"{report['batch_size']}, padding {report['padding_share']:.0%} of tokens, making a batch "
             f"{report['data_seconds_per_batch'] * 1000:.1f} ms, ~{report['matmul_gflops_eager_fp32']:.0f} GFLOP/s "
             f"in the eager fp32 step", "",
             "| variant | tokens/s | x eager fp32 | s/step | forward | backward | optimizer | warm-up (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, v in report["variants"].items():
        share = v["share"]
        lines.append(f"| {name} | {v['tokens_per_s']:,.0f} | {v['ratio_to_eager_fp32']:.2f} | "
                     f"{v['seconds_per_step']:.3f} | {share['forward']:.0%} | {share['backward']:.0%} | "
                     f"{share['optimizer']:.0%} | {v['warmup_seconds']:.1f} |")
    return "\n".join(lines)


def run_command(args: argparse.Namespace) -> None:
    for name in ("steps", "repeats", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name}={value} is not allowed; it must be a positive integer")
    resolve(RunSpec(task=args.task, pe="rope", preset=args.preset))  # refuses a bad task or preset first
    torch.set_num_threads(args.threads)
    report = measure(args.task, args.preset, args.steps, args.repeats, warmup=3, progress=not args.no_progress)
    table = format_report(report)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"training-{args.preset}-{args.task}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")


def add_arguments(bench) -> None:
    """Register `tapelm bench training` under `tapelm bench`."""
    parser = bench.add_parser("training", help="a preset's training step: time per part and the speed-up of "
                                               "torch.compile and bf16 autocast, side by side")
    parser.add_argument("--task", default="addition", help="task whose preset run is measured (default: %(default)s)")
    parser.add_argument("--preset", default="cpu-small", help="preset (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="steps per repetition (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions; medians reported (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s, the preset's)")
    parser.add_argument("--out", default="bench-results", help="folder for the JSON (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines")
    parser.set_defaults(handler=run_command)
