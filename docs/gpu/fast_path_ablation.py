"""What each fast path gives RoPE and TAPE alone: the training step and batch-1 decoding with no fast path, with each
one alone, and with all of them, at one of `bench speed`'s sizes, in one process.

Every forward pass resolves its config's `fast_paths` (`tapelm.fast_paths.resolve`), so one model per encoding serves
every setting: a setting is the list of path names the models' `fast_paths` holds while it is measured. Each
repetition visits
every setting in turn (the training steps of all settings first, then, the models in the decoding dtype, the decoding
steps), so the ratios of one repetition are taken under the same load. The first visit of a setting is not timed:
Triton and fla compile and autotune there. The JSON holds every time and, per setting, each encoding's time as a
ratio to its own time with no fast path (mean and 95% interval over repetitions) and TAPE / RoPE.

    python docs/gpu/fast_path_ablation.py --device cuda --dtype bf16 --size paper-1k --repeats 5 --out DIR
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from tapelm.analysis.statistics import interval
from tapelm.bench.speed import SIZES, Options, Workload, check_device
from tapelm.training.provenance import environment

OFFERED = {
    "cuda": (
        "attention-unpadded",
        "rotation-autograd",
        "rotation-triton",
        "rotation-fla",
        "norm-fla",
        "mlp-fla",
        "loss-fla",
        "state-mixing-triton",
    ),
    "cpu": ("attention-cpu-flash", "rotation-autograd"),
}
"""The fast paths that RoPE's and TAPE's training and decoding can take, by device type."""
ROWS = ("rope", "tape")
TRAIN_STEPS = 3
"""Timed training steps per setting and repetition (their median counts)."""
DECODE_TOKENS = 16
"""Timed decoding steps per setting and repetition, after a 2,048-token prompt (the size's decode context)."""


def choose(workloads: dict, paths: tuple[str, ...]) -> None:
    """Every model runs exactly `paths` from its next forward pass on."""
    for workload in workloads.values():
        workload.model.config.fast_paths = list(paths)


def train_seconds(workload: Workload) -> float:
    return sorted(workload.train_step() for _ in range(TRAIN_STEPS))[TRAIN_STEPS // 2]


@torch.no_grad()
def decode_seconds(workload: Workload, cache: DynamicCache, token: torch.Tensor) -> float:
    """Seconds per batch-1 decoding step on `cache`, left as long as it was."""
    length = cache.get_seq_length()
    workload.options.synchronize()
    start = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        token = workload.model(token, use_cache=True, cache=cache).logits[:, -1:].argmax(-1)
    workload.options.synchronize()
    seconds = (time.perf_counter() - start) / DECODE_TOKENS
    cache.crop(length - cache.get_seq_length())  # tapelm's cache layers take the tokens to remove, negative
    return seconds


@torch.no_grad()
def prefilled(workload: Workload) -> DynamicCache:
    cache = DynamicCache(config=workload.model.config)
    prompt = workload.prompt[:1]
    for start in range(0, prompt.shape[1], 512):
        workload.model(prompt[:, start : start + 512], use_cache=True, cache=cache)
    return cache


def summary(times: dict[str, dict[str, list[float]]]) -> dict[str, dict]:
    """Per setting: each row's time over its own with no fast path, and TAPE / RoPE, as intervals over repetitions."""
    none = times["none"]
    return {
        setting: {
            **{f"{row} / {row} with none": interval([t / b for t, b in zip(rows[row], none[row])]) for row in ROWS},
            "tape / rope": interval([t / r for t, r in zip(rows["tape"], rows["rope"])]),
        }
        for setting, rows in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bf16"], default="float32")
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("fast-path-ablation"))
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error(f"--repeats must be at least 2 for an interval (got {args.repeats})")
    device = check_device(args.device)
    if device.type not in OFFERED:
        parser.error(f"--device {args.device}: the fast paths are measured on cpu or cuda")
    size, options = SIZES[args.size], Options(device=device, bf16=args.dtype == "bf16")
    settings = {"none": (), **{name: (name,) for name in OFFERED[device.type]}, "all": OFFERED[device.type]}
    workloads = {row: Workload(size, row, options) for row in ROWS}
    record = {
        "size": args.size,
        "options": options.record(),
        "environment": environment(),
        "train_steps": TRAIN_STEPS,
        "decode_tokens": DECODE_TOKENS,
        "decode_context": size.decode_context,
        "settings": {name: list(paths) for name, paths in settings.items()},
    }

    train = {setting: {row: [] for row in ROWS} for setting in settings}
    for repeat in range(args.repeats + 1):
        for setting, paths in settings.items():
            choose(workloads, paths)
            for row, workload in workloads.items():
                seconds = train_seconds(workload)
                if repeat:
                    train[setting][row].append(seconds)
        print(f"training, repetition {repeat} of {args.repeats} done", flush=True)

    for workload in workloads.values():
        workload.for_decoding()
    caches = {row: prefilled(workload) for row, workload in workloads.items()}
    token = workloads["rope"].prompt[:1, -1:]
    decode = {setting: {row: [] for row in ROWS} for setting in settings}
    for repeat in range(args.repeats + 1):
        for setting, paths in settings.items():
            choose(workloads, paths)
            for row, workload in workloads.items():
                seconds = decode_seconds(workload, caches[row], token)
                if repeat:
                    decode[setting][row].append(seconds)
        print(f"decoding, repetition {repeat} of {args.repeats} done", flush=True)

    record.update(
        train_step_s=train, decode_s_per_token_batch1=decode, train=summary(train), decode_batch1=summary(decode)
    )
    print("times: each encoding's over its own with no fast path, and TAPE's over RoPE's in the same setting")
    print(
        f"{'setting':26s} {'RoPE step':>12s} {'TAPE step':>12s} {'TAPE / RoPE':>12s}"
        f" {'RoPE decode':>12s} {'TAPE decode':>12s} {'TAPE / RoPE':>12s}"
    )
    for setting in settings:
        cells = [
            record[part][setting][key]
            for part in ("train", "decode_batch1")
            for key in ("rope / rope with none", "tape / tape with none", "tape / rope")
        ]
        print(f"{setting:26s} " + " ".join(f"{c['mean']:6.3f}±{c['half_width']:5.3f}" for c in cells))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"fast-path-ablation-{device.type}-{args.size}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
