"""The `tapelm` command: each part of the package registers its own sub-commands here.

`check-encoding` needs the model library alone; every other command is the lab's, registered when `tapelm[lab]` is
installed, and named with the extra to install when it is not."""

from __future__ import annotations

import argparse
import sys

from .extras import missing

MODEL_COMMANDS = ("check-encoding",)


def build_parser(lab: bool = True) -> argparse.ArgumentParser:
    """The command's parser; `lab`: with the lab's commands (they import the lab's packages)."""
    parser = argparse.ArgumentParser(
        prog="tapelm",
        description="TAPE and its baseline positional encodings.",
        epilog=None if lab else "The lab's commands (train, compare, report, ...) need: pip install 'tapelm[lab]'",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_check_encoding(commands)
    if lab:
        _add_lab_commands(commands)
    return parser


def _add_lab_commands(commands) -> None:
    from .bench import speed, training
    from .doctor import doctor
    from .experiments import commands as experiment_commands
    from .pretrained import commands as pretrained_commands
    from .report import add_commands as add_report_commands
    from .scrolls import commands as scrolls_commands

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


def _add_check_encoding(commands) -> None:
    from .testing import LAWS

    parser = commands.add_parser(
        "check-encoding",
        help="hold a registered encoding to the laws every encoding obeys (tapelm.testing)",
        description="Run the conformance kit's laws on one registered encoding (tapelm's own, or one an installed "
        "package registers) with tiny float64 models; print each law's verdict and the largest difference it "
        "measured; exit 1 when a law fails.",
    )
    parser.add_argument("name", help="the encoding's registered name (pe_type)")
    parser.add_argument("--law", nargs="+", metavar="LAW", help=f"only these laws (default: all: {', '.join(LAWS)})")
    parser.add_argument("--device", default="cpu", help="device of the tiny models (default: %(default)s)")
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile's backend for the `compiles` law (default: %(default)s; eager: the capture alone)",
    )
    parser.set_defaults(handler=_cli_check_encoding)


def _cli_check_encoding(args) -> int:
    from .testing import check_encoding

    verdicts = check_encoding(args.name, args.law, args.device, args.compile_backend)
    for verdict in verdicts:
        if verdict.held:
            print(f"held  {verdict.law} (largest difference {verdict.measured:.1e})")
        else:
            print(f"FAILED  {verdict.failure}")
    failed = sum(not verdict.held for verdict in verdicts)
    print(f"{args.name}: {len(verdicts) - failed} of {len(verdicts)} laws held")
    return 1 if failed else 0


def _as_flags(message: str, lab: bool) -> str:
    """A library error's argument names said as the command's flags (the lab's commands name them)."""
    if not lab:
        return message
    from .experiments.commands import as_flags

    return as_flags(message)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    lacking = missing("lab")
    command = next((word for word in argv if not word.startswith("-")), None)
    if lacking and command is not None and command not in MODEL_COMMANDS:
        print(
            f"tapelm: error: `tapelm {command}` is a lab command and needs tapelm's lab extra, which is not installed "
            f"(missing: {', '.join(lacking)}): pip install 'tapelm[lab]'",
            file=sys.stderr,
        )
        return 2
    args = build_parser(lab=not lacking).parse_args(argv)
    try:
        status = args.handler(args)  # None or 0: done; another number: part of the work failed
    except ValueError as error:
        print(f"tapelm: error: {_as_flags(str(error), not lacking)}", file=sys.stderr)
        return 2
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
