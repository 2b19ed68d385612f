"""Where RoPE's and TAPE's time goes, kernel by kernel: torch.profiler over a few eager training steps and a few
compiled batch-1 decoding steps at one of `bench speed`'s sizes.

Training runs as `bench speed` trains (bf16 autocast with --dtype bf16, the fast-path setting given). Decoding runs
the decode step compiled as one graph on a static cache after the size's prompt, without CUDA graphs, so that the
profiler sees each kernel: the sum of their device times is what a CUDA-graph replay of the step costs, less its few
gaps. Per row and part the JSON holds each operation's calls and self time per step on the device (the CPU's where
there is no GPU), largest first; a text table of the first rows goes beside it.

    python docs/gpu/profile_steps.py --device cuda --dtype bf16 --size paper-1k --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import StaticCache

from tapelm.bench.speed import SIZES, Options, Workload, check_device, fast_path_setting
from tapelm.training.provenance import environment

STEPS = 3
"""Profiled steps per part (after two untimed ones: compiling, autotuning, the allocator's warm-up)."""
ROWS = ("rope", "tape")


def profiled(run, device: torch.device, options: Options) -> list[dict]:
    """Each operation's calls and self time (µs) per step over STEPS calls of `run`, largest first."""
    for _ in range(2):
        run()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    options.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(STEPS):
            run()
        options.synchronize()
    time_key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    rows = [
        {"name": event.key, "calls_per_step": event.count / STEPS, "self_us_per_step": getattr(event, time_key) / STEPS}
        for event in prof.key_averages()
    ]
    return sorted((row for row in rows if row["self_us_per_step"] > 0), key=lambda row: -row["self_us_per_step"])


def decode_step(workload: Workload):
    """A compiled batch-1 decoding step on a static cache holding the prompt but its last token, which each call
    decodes and then crops off again."""
    workload.for_decoding()
    model, prompt = workload.model, workload.prompt[:1]
    cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1])
    with torch.no_grad():
        for start in range(0, prompt.shape[1] - 1, 512):
            model(prompt[:, start : min(start + 512, prompt.shape[1] - 1)], use_cache=True, cache=cache)
    step = torch.compile(model, dynamic=False, fullgraph=True)
    token = prompt[:, -1:]

    @torch.no_grad()
    def run():
        step(token, use_cache=True, cache=cache)
        cache.crop(-1)

    return run


def table(rows: list[dict], lines: int = 25) -> str:
    total = sum(row["self_us_per_step"] for row in rows)
    out = [f"total {total / 1e3:.2f} ms per step", f"{'µs/step':>10s} {'share':>6s} {'calls':>6s}  operation"]
    out += [
        f"{row['self_us_per_step']:10.1f} {row['self_us_per_step'] / total:6.1%} {row['calls_per_step']:6.0f}  "
        f"{row['name'][:100]}"
        for row in rows[:lines]
    ]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bf16"], default="float32")
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--fast-paths", nargs="+", default=["auto"], help="a setting or path names (bench speed's)")
    parser.add_argument("--out", type=Path, default=Path("profile-steps"))
    args = parser.parse_args()
    device = check_device(args.device)
    size = SIZES[args.size]
    options = Options(device=device, bf16=args.dtype == "bf16", fast_paths=fast_path_setting(args.fast_paths))
    record = {"size": args.size, "options": options.record(), "environment": environment(), "steps": STEPS, "rows": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for row in ROWS:
        workload = Workload(size, row, options)
        parts = {"train": profiled(workload.train_step, device, options)}
        parts["decode"] = profiled(decode_step(workload), device, options)
        record["rows"][row] = parts
        for part, rows in parts.items():
            text = table(rows)
            (args.out / f"profile-{row}-{part}.txt").write_text(text + "\n")
            print(f"== {row}, {part}\n{text}\n", flush=True)
        del workload
    path = args.out / f"profile-{device.type}-{args.size}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
