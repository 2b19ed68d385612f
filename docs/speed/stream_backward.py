"""The attention backward pass on the CPU, alone: SDPA's flash backward against `stream_attention_backward` (plain
matrix products over blocks of queries), for a value as wide as q and k (RoPE's call) and for TAPE's [V | E] stream
twice as wide (where the flash backward needs q and k zero-padded to the stream's width), with SDPA's causal flag
and with a mask tensor (causal, the first fifth of every sequence padding that sees only itself). The shapes are one
layer of `bench speed`'s size; each repetition times every variant in turn, and the JSON holds each variant's times
and its median ratio to the flash backward of the same width and mask.

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

from tapelm.bench.speed import SIZES
from tapelm.kernels.attention.cpu_flash import stream_attention_backward
from tapelm.training.provenance import environment

BLOCKS = (32, 64, 128)


def padding_mask(size) -> torch.Tensor:
    """An additive causal mask (B, 1, N, N) whose first fifth of keys is padding: hidden from every query but itself."""
    causal = torch.ones(size.seq, size.seq, dtype=torch.bool).tril()
    visible = causal.expand(size.batch, 1, -1, -1).clone()
    pads = torch.arange(size.seq // 5)
    visible[..., : size.seq // 5] = False
    visible[..., pads, pads] = True
    return torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))


def variants(size, width_factor: int, mask: torch.Tensor | None) -> dict:
    """name -> a function running one backward pass, for a stream `width_factor` times as wide as q, with SDPA's causal
    flag (mask None) or the additive mask."""
    head_dim = size.hidden // size.heads
    width, scale = width_factor * head_dim, head_dim**-0.5
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(size.batch, size.heads, size.seq, head_dim, generator=generator)
    k = torch.randn(size.batch, size.kv_heads, size.seq, head_dim, generator=generator)
    stream = torch.randn(size.batch, size.kv_heads, size.seq, width, generator=generator)
    grad_out = torch.randn(size.batch, size.heads, size.seq, width, generator=generator)
    pad = (0, width - head_dim)
    causal = mask is None
    out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        F.pad(q, pad), F.pad(k, pad), stream, 0.0, causal, attn_mask=mask, scale=scale
    )
    delta = (grad_out * out).sum(-1)

    def flash():
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, F.pad(q, pad), F.pad(k, pad), stream, out, logsumexp, 0.0, causal, attn_mask=mask, scale=scale
        )

    def blockwise(block):
        return lambda: stream_attention_backward(grad_out, q, k, stream, logsumexp, delta, causal, scale, mask, block)

    return {"flash": flash, **{f"blocks of {block}": blockwise(block) for block in BLOCKS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("docs/speed/stream-backward.json"))
    args = parser.parse_args()
    size = SIZES[args.size]
    record = {"size": args.size, "repeats": args.repeats, "environment": environment(), "widths": {}}
    cases = [
        (factor, width, masked)
        for masked in (False, True)
        for factor, width in ((1, "as wide as q (RoPE)"), (2, "twice as wide (TAPE's [V | E])"))
    ]
    for factor, width, masked in cases:
        name = f"{width}, {'a mask tensor' if masked else 'causal flag'}"
        runs = variants(size, factor, padding_mask(size) if masked else None)
        times = {variant: [] for variant in runs}
        for run in runs.values():
            run()
        for _ in range(args.repeats):
            for variant, run in runs.items():
                start = time.perf_counter()
                run()
                times[variant].append(time.perf_counter() - start)
        record["widths"][name] = {
            variant: {
                "median_ms": 1000 * statistics.median(seconds),
                "times_s": seconds,
                "x_flash": statistics.median(seconds) / statistics.median(times["flash"]),
            }
            for variant, seconds in times.items()
        }
        for variant, entry in record["widths"][name].items():
            print(f"{name:48s} {variant:16s} {entry['median_ms']:7.1f} ms  {entry['x_flash']:.2f}x flash")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
