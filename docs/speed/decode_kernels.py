"""The kernels one compiled decoding step launches, per encoding: the code inductor generates for the step (a static
cache, one graph, as `bench speed --compile` decodes), its kernels counted: fused ones (C++ on the CPU, Triton on
CUDA) and calls out to library kernels (mm, bmm, ...). A compiled decode step on a GPU is bound by the number and
latency of its kernels (docs/SPEED.md), so the count says what TAPE adds to each layer before a GPU measures it.

    python docs/speed/decode_kernels.py [--size tiny] [--device cpu] [--out docs/speed/decode-kernels.json] ROW...
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code
from transformers import StaticCache

from tapelm.bench.speed import SIZES, build_model
from tapelm.training.provenance import environment

FUSED = re.compile(r"^(cpp_fused_\w+)\(|^(triton_\w+)\.run\(")
LIBRARY = re.compile(r"^(?:\w+ = )?(?:extern_kernels\.(\w+)|torch\.ops\.aten\.(\w+)\.\w+)\(")


def step_code(row: str, size_name: str, device: torch.device) -> str:
    """Inductor's code for one decoding step of `row` at batch 1 after an 8-token prompt."""
    size = SIZES[size_name]
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(size, row, "auto").eval()
    ids = torch.randint(0, size.vocab, (1, 8), device=device)
    cache = StaticCache(config=model.config, max_cache_len=32)
    step = torch.compile(model, dynamic=False, fullgraph=True)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        _, codes = run_and_get_code(lambda: step(ids[:, -1:], cache=cache, use_cache=True))
    return codes[-1]


def count(code: str) -> dict:
    """The kernels the generated `call` launches, fused and library, with the library ones by name."""
    lines = [line.strip() for line in code[code.index("def call(") :].splitlines()]
    fused = [match.group(1) or match.group(2) for match in map(FUSED.match, lines) if match]
    library = Counter(match.group(1) or match.group(2) for match in map(LIBRARY.match, lines) if match)
    return {
        "kernels": len(fused) + sum(library.values()),
        "fused": len(fused),
        "library": dict(sorted(library.items())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="+", help="encodings or TAPE variants, as bench speed names them")
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("docs/speed/decode-kernels.json"))
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = {row: count(step_code(row, args.size, device)) for row in args.rows}
    record = {
        "command": "python docs/speed/decode_kernels.py "
        + " ".join([*args.rows, "--size", args.size, "--device", args.device]),
        "size": args.size,
        "layers": SIZES[args.size].layers,
        "device": str(device),
        "environment": environment(),
        "rows": rows,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for row, counts in rows.items():
        print(f"{row}: {counts['kernels']} kernels ({counts['fused']} fused, library {counts['library']})")


if __name__ == "__main__":
    main()
