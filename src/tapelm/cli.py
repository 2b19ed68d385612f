"""The `tapelm` command: each part of the package registers its own sub-commands here."""

from __future__ import annotations

import argparse
import sys

from .bench import speed, training
from .doctor import doctor
from .experiments import commands as experiment_commands
from .pretrained import commands as pretrained_commands
from .report import add_commands as add_report_commands
from .scrolls import commands as scrolls_commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tapelm", description="TAPE and its baseline positional encodings.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(
        dest="benchmark", required=True, metavar="BENCHMARK"
    )
    speed.add_arguments(bench)  # bench speed
    training.add_arguments(bench)  # bench training
    doctor.add_commands(commands)  # doctor
    experiment_commands.add_commands(commands)  # train, eval, compare
    add_report_commands(commands)  # report
    pretrained_commands.add_commands(commands)  # convert, finetune
    scrolls_commands.add_commands(commands)  # scrolls finetune / predict / score / run / laptop
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = args.handler(args)  # None or 0: done; another number: part of the work failed
    except ValueError as error:
        print(
            f"tapelm: error: {experiment_commands.as_flags(str(error))}", file=sys.stderr
        )  # the library's names as flags
        return 2
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
