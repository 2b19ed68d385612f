"""The attention backward pass on the CPU, alone: SDPA's flash backward against `stream_attention_backward` (plain
matrix products over blocks of queries), for a value as wide as q and k (RoPE's call) and for TAPE's [V | E] stream
twice as wide (where the flash backward needs q and k zero-padded to the stream's width). The shapes are one layer of
`bench speed`'s size; each repetition times every variant in turn, and the JSON holds each variant's times and its
median ratio to the flash backward of the same width.

    python docs/speed/stream_backward.py [--size small] [--repeats 15] [--out docs/speed/stream-backward.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tapelm.attention import stream_attention_backward
from tapelm.bench.speed import SIZES
from tapelm.experiments.provenance import environment

BLOCKS = (32, 64, 128)


def variants(size, width_factor: int) -> dict:
    """name -> a function running one backward pass, for a stream `width_factor` times as wide as q."""
    head_dim = size.hidden // size.heads
    width, scale = width_factor * head_dim, head_dim**-0.5
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(size.batch, size.heads, size.seq, head_dim, generator=generator)
    k = torch.randn(size.batch, size.kv_heads, size.seq, head_dim, generator=generator)
    stream = torch.randn(size.batch, size.kv_heads, size.seq, width, generator=generator)
    grad_out = torch.randn(size.batch, size.heads, size.seq, width, generator=generator)
    pad = (0, width - head_dim)
    out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        F.pad(q, pad), F.pad(k, pad), stream, 0.0, True, scale=scale)
    delta = (grad_out * out).sum(-1)

    def flash():
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, F.pad(q, pad), F.pad(k, pad), stream, out, logsumexp, 0.0, True, scale=scale)

    def blockwise(block):
        return lambda: stream_attention_backward(grad_out, q, k, stream, logsumexp, delta, True, scale, block)

    return {"flash": flash, **{f"blocks of {block}": blockwise(block) for block in BLOCKS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("docs/speed/stream-backward.json"))
    args = parser.parse_args()
    size = SIZES[args.size]
    record = {"size": args.size, "repeats": args.repeats, "environment": environment(), "widths": {}}
    for factor, name in ((1, "as wide as q (RoPE)"), (2, "twice as wide (TAPE's [V | E])")):
        runs = variants(size, factor)
        times = {variant: [] for variant in runs}
        for run in runs.values():
            run()
        for _ in range(args.repeats):
            for variant, run in runs.items():
                start = time.perf_counter()
                run()
                times[variant].append(time.perf_counter() - start)
        record["widths"][name] = {
            variant: {"median_ms": 1000 * statistics.median(seconds), "times_s": seconds,
                      "x_flash": statistics.median(seconds) / statistics.median(times["flash"])}
            for variant, seconds in times.items()}
        for variant, entry in record["widths"][name].items():
            print(f"{name:32s} {variant:16s} {entry['median_ms']:7.1f} ms  {entry['x_flash']:.2f}x flash")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
