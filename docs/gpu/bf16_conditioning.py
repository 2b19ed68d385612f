"""How precisely bf16 computes the law tests' tiny TAPE models, by the scale of their random weights.

For each TAPE variant and batch of tests/test_fast_paths.py and each seed, one training pass on the reference path in
bf16 and in float64 (on the CPU): the worst relative error (Euclidean norm) over the logits, the loss and every
gradient. A comparison of a fast path with the reference path in bf16 can only see a wrong result well above that
error. Writes the median and worst per scale as JSON:

    python docs/gpu/bf16_conditioning.py --scales 0.3 0.1 --seeds 2 --out docs/gpu/bf16-conditioning.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import tiny_model, tokens  # noqa: E402
from test_fast_paths import BATCHES, TAPE_VARIANTS, trained_pass  # noqa: E402


def worst_relative_error(variant: str, batch: str, seed: int, scale: float) -> float:
    def run(dtype):
        model = tiny_model("tape", dtype, seed, scale, fast_paths="off", **TAPE_VARIANTS[variant])
        return trained_pass(model, tokens(2, 16, seed=seed), batch)

    truth, rounded = run(torch.float64), run(torch.bfloat16)
    return max(
        (rounded[name].double() - value).norm().item() / value.norm().item()
        for name, value in truth.items()
        if value is not None and value.norm() > 1e-9
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scales", type=float, nargs="+", default=[0.3, 0.1])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/gpu/bf16-conditioning.json"))
    args = parser.parse_args()
    if args.seeds < 1 or min(args.scales) <= 0:
        parser.error("--seeds must be at least 1 and every --scales entry above 0")
    torch.set_num_threads(1)
    results = {}
    for scale in args.scales:
        errors = [
            worst_relative_error(variant, batch, seed, scale)
            for variant, batch, seed in itertools.product(TAPE_VARIANTS, BATCHES, range(args.seeds))
        ]
        results[str(scale)] = {
            "runs": len(errors),
            "median": statistics.median(errors),
            "worst": max(errors),
            "best": min(errors),
        }
        print(
            f"weight scale {scale}: worst relative error per run, median {results[str(scale)]['median']:.3f}, "
            f"worst {max(errors):.3f}, best {min(errors):.3f} ({len(errors)} runs)",
            flush=True,
        )
    args.out.write_text(json.dumps({"seeds": args.seeds, "scales": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
