"""The `tapelm` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import PE_TYPES


def _bench_speed(args: argparse.Namespace) -> None:
    import torch

    from .speed import run

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads={args.threads} is not allowed; it must be a positive integer")
        torch.set_num_threads(args.threads)
    sizes = ["quick"] if args.quick else args.sizes
    run(sizes, args.pe or list(PE_TYPES), Path(args.out), progress=not args.no_progress)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tapelm", description="TAPE and its baseline positional encodings.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="benchmark", required=True,
                                                                            metavar="BENCHMARK")
    speed = bench.add_parser("speed", help="training, prefill and decode speed and memory of every encoding, "
                                           "as ratios to RoPE")
    speed.add_argument("--quick", action="store_true",
                       help="one small size with short sequences (a table in about two minutes on 2 CPU cores)")
    speed.add_argument("--sizes", nargs="+", choices=["small", "large"], default=["small", "large"],
                       help="sizes to measure (default: both)")
    speed.add_argument("--pe", nargs="+", choices=PE_TYPES, metavar="PE",
                       help=f"encodings (default: all of {', '.join(PE_TYPES)}); RoPE is always included")
    speed.add_argument("--out", default="bench-results", help="folder for the JSON and PNG (default: %(default)s)")
    speed.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    speed.add_argument("--no-progress", action="store_true", help="no progress bar")
    speed.set_defaults(handler=_bench_speed)

    from .runs_cli import add_commands as add_run_commands

    add_run_commands(commands)  # train, eval, compare, report

    from .convert import register_cli as add_retrofit_commands

    add_retrofit_commands(commands)  # convert, finetune
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.handler(args)
    except ValueError as error:
        print(f"tapelm: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
