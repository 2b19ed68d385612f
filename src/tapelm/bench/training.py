"""`tapelm bench training`: where a preset's training step spends its time, and what the ways of making it faster
that this machine offers actually give, measured side by side in one process.

The workload is a preset's own run (model, batch, data stream; default cpu-small addition), for each encoding asked
(default TAPE and RoPE). Variants, timed interleaved (each repetition visits every encoding and variant), medians
reported as tokens per second (real, unpadded tokens) and as ratios to the first variant of the same encoding:

- `padded grid`: every token of the padded batch goes through the per-token work (tapelm before `tapelm.layout`);
- `real tokens`: norms, projections and the MLP on the real tokens only (the default);
- `real tokens, compiled layers`: the same with `compile_layers()` (torch.compile, inductor, per decoder layer);
- `real tokens, bf16 autocast`: bfloat16 autocast (only when asked: without AVX-512 BF16 or AMX it is far slower).

Beside them: the share of a step spent in the forward pass, the backward pass and the optimizer, the time to make a
batch, the padding share, and the achieved matrix-multiply rate of the plain step.
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

from ..experiments.runs import RunSpec, batch_stream, resolve
from ..positional import encoding_names
from ..training.provenance import environment

# name -> (skip padding, compile the layers, bf16 autocast)
VARIANTS = {
    "padded grid": (False, False, False),
    "real tokens": (True, False, False),
    "real tokens, compiled layers": (True, True, False),
    "real tokens, bf16 autocast": (True, False, True),
}
DEFAULT_VARIANTS = ("padded grid", "real tokens", "real tokens, compiled layers")


class Variant:
    """One way of running the same training step on its own copy of the model."""

    def __init__(self, run, skip_padding: bool, compiled: bool, bf16: bool):
        self.model = run.build_model().train()
        self.model.model.skip_padding = skip_padding
        if compiled:
            self.model.compile_layers()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=run.settings.lr)
        self.bf16 = bf16

    def step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One step; seconds in forward, backward and the optimizer."""
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        start = time.perf_counter()
        with autocast:
            loss = self.model(**batch).loss
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        end = time.perf_counter()
        return {"forward": forward - start, "backward": backward - forward, "optimizer": end - backward}


def measure(
    task: str,
    preset: str,
    pes: list[str],
    variants: list[str],
    steps: int,
    repeats: int,
    warmup: int,
    progress: bool = True,
) -> dict[str, Any]:
    runs = {pe: resolve(RunSpec(task=task, pe=pe, preset=preset)) for pe in pes}
    first = runs[pes[0]]
    make_batch = batch_stream(first.task, 0, first.settings.batch_size)
    started = time.perf_counter()
    batches = [make_batch(i) for i in range(warmup + steps)]
    data_seconds = (time.perf_counter() - started) / len(batches)
    real = [int(b["attention_mask"].sum()) for b in batches[warmup:]]
    padded = [b["input_ids"].numel() for b in batches[warmup:]]
    entries: dict[tuple[str, str], dict[str, Any]] = {}
    for pe, run in runs.items():
        for name in variants:
            torch.manual_seed(0)
            variant = Variant(run, *VARIANTS[name])
            started = time.perf_counter()
            for batch in batches[:warmup]:
                variant.step(batch)
            entries[pe, name] = {"variant": variant, "warmup_seconds": time.perf_counter() - started, "steps": []}
            if progress:
                print(f"{pe} / {name}: warm-up {entries[pe, name]['warmup_seconds']:.1f} s", flush=True)
    for repeat in range(repeats):
        for entry in entries.values():
            parts = [entry["variant"].step(batch) for batch in batches[warmup:]]
            entry["steps"].append({key: sum(p[key] for p in parts) for key in parts[0]})
        if progress:
            print(f"repetition {repeat + 1}/{repeats} done", flush=True)
    report = {
        "task": task,
        "preset": preset,
        "encodings": pes,
        "steps_per_repeat": steps,
        "repeats": repeats,
        "batch_size": first.settings.batch_size,
        "padding_share": 1 - sum(real) / sum(padded),
        "data_seconds_per_batch": data_seconds,
        "results": {},
        "environment": environment(),
    }
    for (pe, name), entry in entries.items():
        totals = [sum(s.values()) for s in entry["steps"]]
        median = statistics.median(totals)
        index = totals.index(median)
        parameters = sum(p.numel() for p in entry["variant"].model.parameters())
        report["results"].setdefault(pe, {"parameters": parameters, "variants": {}})["variants"][name] = {
            "tokens_per_s": sum(real) / median,
            "seconds_per_step": median / steps,
            "share": {key: value / median for key, value in entry["steps"][index].items()},
            "warmup_seconds": entry["warmup_seconds"],
        }
    for result in report["results"].values():
        base = result["variants"][variants[0]]
        for entry in result["variants"].values():
            entry["ratio_to_first"] = entry["tokens_per_s"] / base["tokens_per_s"]
        # 6 FLOPs per parameter and padded token (forward + backward), the attention not counted.
        result["matmul_gflops_first"] = 6 * result["parameters"] * sum(padded) / steps / base["seconds_per_step"] / 1e9
    return report


def format_report(report: dict[str, Any]) -> str:
    variants = list(next(iter(report["results"].values()))["variants"])
    lines = [
        f"{report['task']} / {report['preset']}: batch {report['batch_size']}, padding "
        f"{report['padding_share']:.0%} of tokens, making a batch {report['data_seconds_per_batch'] * 1000:.1f} "
        f"ms; ratios to '{variants[0]}' of the same encoding, and to its RoPE row where RoPE was measured",
        "",
        "| encoding | variant | tokens/s | x first | x RoPE | s/step | forward | backward | optimizer | warm-up (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rope = report["results"].get("rope", {}).get("variants", {})
    for pe, result in report["results"].items():
        for name, v in result["variants"].items():
            share = v["share"]
            versus = f"{v['tokens_per_s'] / rope[name]['tokens_per_s']:.2f}" if name in rope else "–"
            lines.append(
                f"| {pe} | {name} | {v['tokens_per_s']:,.0f} | {v['ratio_to_first']:.2f} | {versus} | "
                f"{v['seconds_per_step']:.3f} | {share['forward']:.0%} | {share['backward']:.0%} | "
                f"{share['optimizer']:.0%} | {v['warmup_seconds']:.1f} |"
            )
    return "\n".join(lines)


def run_command(args: argparse.Namespace) -> None:
    for name in ("steps", "repeats", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name}={value} is not allowed; it must be a positive integer")
    for pe in args.pe:
        resolve(RunSpec(task=args.task, pe=pe, preset=args.preset))  # refuses a bad task, encoding or preset first
    for name in args.variants:
        if name not in VARIANTS:
            raise ValueError(f"unknown variant '{name}'; choose from: {', '.join(map(repr, VARIANTS))}")
    torch.set_num_threads(args.threads)
    report = measure(
        args.task,
        args.preset,
        args.pe,
        args.variants,
        args.steps,
        args.repeats,
        warmup=3,
        progress=not args.no_progress,
    )
    table = format_report(report)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"training-{args.preset}-{args.task}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")


def add_arguments(bench) -> None:
    """Register `tapelm bench training` under `tapelm bench`."""
    parser = bench.add_parser(
        "training",
        help="a preset's training step: time per part, and skipping padding, "
        "compiled layers and bf16 autocast side by side",
    )
    parser.add_argument("--task", default="addition", help="task whose preset run is measured (default: %(default)s)")
    parser.add_argument("--preset", default="cpu-small", help="preset (default: %(default)s)")
    parser.add_argument(
        "--pe",
        nargs="+",
        default=["tape", "rope"],
        choices=encoding_names(),
        metavar="PE",
        help="encodings (default: tape rope)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(DEFAULT_VARIANTS),
        metavar="VARIANT",
        help=f"from: {', '.join(map(repr, VARIANTS))} (default: the first three)",
    )
    parser.add_argument("--steps", type=int, default=10, help="steps per repetition (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions; medians reported (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s, the preset's)")
    parser.add_argument("--out", default="bench-results", help="folder for the JSON (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines")
    parser.set_defaults(handler=run_command)
