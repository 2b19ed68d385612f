"""Registers the task-run commands (`tapelm train`, `eval`, `compare`, `report`) on the `tapelm` parser."""

from __future__ import annotations


def add_commands(commands) -> None:
    """Add train, eval, compare and report to the `tapelm` sub-command parser `commands`."""
    from . import compare, evaluate, runs
    from .report import add_commands as add_report

    runs.add_commands(commands)
    evaluate.add_commands(commands)
    compare.add_commands(commands)
    add_report(commands)
