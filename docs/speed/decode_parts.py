"""Where TAPE's batch-1 decoding time goes on the CPU: tokens/s of RoPE, of TAPE, and of TAPE with its two state
updates skipped (the state passes through each layer unchanged; the [V | E] stream is still cached and read), at
several context lengths, at one of `bench speed`'s sizes. The skipped variant computes nothing anyone would train:
it bounds what faster updates could give, the rest of TAPE's cost being the wider cache it reads.

Each repetition decodes a few tokens with each variant in turn on a cache of fixed length (each new token cropped off
again), so the ratios of one repetition are taken under the same load; the JSON holds every time and each variant's
tokens/s ratio to RoPE (mean and 95% interval over repetitions) with the bytes bound of `bench speed`, and what the
updates cost inside a decoding step: the median over repetitions of TAPE's time per token less the skipped
variant's, per updating layer and as a share of TAPE's time.

    python docs/speed/decode_parts.py [--size small] [--contexts 16 1024 2048 4096] [--repeats 60]
        [--out docs/speed/decode-parts.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from tapelm.analysis.statistics import interval
from tapelm.bench.speed import SIZES, Options, Workload, cache_bytes
from tapelm.training.provenance import environment

TOKENS = 8
"""Decoded tokens per variant and repetition."""


def skip_updates(model, skipped: bool) -> None:
    """Make every TAPE layer of `model` pass its state through its updates unchanged (or restore them)."""
    for layer in model.model.layers:
        for hook in ("after_attention", "after_mlp"):
            if skipped:
                setattr(layer.positional, hook, lambda state, *_: state)
            else:
                layer.positional.__dict__.pop(hook, None)


def prefilled(model, prompt: torch.Tensor) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    for start in range(0, prompt.shape[1], 512):
        model(prompt[:, start : start + 512], use_cache=True, cache=cache)
    return cache


def seconds_per_token(model, cache: DynamicCache, token: torch.Tensor) -> float:
    """Seconds per decoding step on `cache`, which is left as long as it was."""
    model(token, use_cache=True, cache=cache)
    cache.crop(-1)
    start = time.perf_counter()
    for _ in range(TOKENS):
        model(token, use_cache=True, cache=cache)
        cache.crop(-1)
    return (time.perf_counter() - start) / TOKENS


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--contexts", type=int, nargs="+", default=[16, 1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--out", type=Path, default=Path("docs/speed/decode-parts.json"))
    args = parser.parse_args()
    if min(args.contexts) < 1 or args.repeats < 2:
        parser.error(
            f"--contexts must be at least 1 (got {args.contexts}) and --repeats at least 2 for an interval "
            f"(got {args.repeats})"
        )
    size, options = SIZES[args.size], Options(device=torch.device("cpu"))
    workloads = {row: Workload(size, row, options) for row in ("rope", "tape")}
    for workload in workloads.values():
        workload.for_decoding()
    rope, tape = workloads["rope"].model, workloads["tape"].model
    updating_layers = sum(
        layer.positional.attention_update or layer.positional.mlp_update for layer in tape.model.layers
    )
    weight_bytes = {row: workload.decode_weight_bytes() for row, workload in workloads.items()}
    prompt = torch.randint(0, size.vocab, (1, max(args.contexts)), generator=torch.Generator().manual_seed(0))
    token = prompt[:, :1]
    record = {
        "size": args.size,
        "repeats": args.repeats,
        "tokens_per_repeat": TOKENS,
        "environment": environment(),
        "updating_layers": updating_layers,
        "contexts": {},
    }
    for context in args.contexts:
        caches = {"rope": prefilled(rope, prompt[:, :context]), "tape": prefilled(tape, prompt[:, :context])}
        times = {"rope": [], "tape": [], "tape, updates skipped": []}
        for _ in range(args.repeats):
            times["rope"].append(seconds_per_token(rope, caches["rope"], token))
            for variant, skipped in (("tape", False), ("tape, updates skipped", True)):
                skip_updates(tape, skipped)
                times[variant].append(seconds_per_token(tape, caches["tape"], token))
            skip_updates(tape, False)
        read = {row: weight_bytes[row] + cache_bytes(caches[row]) for row in caches}
        updates = [full - skipped for full, skipped in zip(times["tape"], times["tape, updates skipped"])]
        entry = {
            "bytes_bound": read["rope"] / read["tape"],
            "bytes_read": read,
            "seconds_per_token": times,
            "x_rope_tokens_per_s": {
                variant: interval([r / t for r, t in zip(times["rope"], seconds)])
                for variant, seconds in times.items()
                if variant != "rope"
            },
            "updates_us_per_layer": statistics.median(updates) / updating_layers * 1e6,
            "updates_share_of_step": statistics.median(u / t for u, t in zip(updates, times["tape"])),
        }
        record["contexts"][str(context)] = entry
        print(
            f"context {context:5d}: bytes bound {entry['bytes_bound']:.3f}; "
            + "; ".join(
                f"{variant} {ratio['mean']:.3f} ± {ratio['half_width']:.3f}x RoPE"
                for variant, ratio in entry["x_rope_tokens_per_s"].items()
            )
            + f"; updates {entry['updates_us_per_layer']:.0f} µs a layer, {entry['updates_share_of_step']:.1%} of "
            "the step",
            flush=True,
        )
        del caches
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
