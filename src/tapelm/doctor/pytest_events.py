"""pytest, each test's start, results and end written as they happen, one JSON object a line, to a file: how
`tapelm doctor` follows its test processes (a process that dies mid-test leaves its test started and not finished).

Run as a script, `python pytest_events.py EVENTS_FILE PYTEST_ARGUMENTS...`, which imports neither tapelm nor torch (the
tests do): the plugin lives in the process that reports (pytest-xdist's controller, not its workers). With
`--stop-at-cuda-error` the session stops after a test whose failure names a CUDA error (`CUDA_ERRORS`), which leaves
the process's CUDA context unusable: the tests after it belong in a fresh process."""

from __future__ import annotations

import json
import re
import sys
import time

CUDA_ERRORS = re.compile(
    r"CUDA error|illegal memory access|device-side assert|unspecified launch failure|"
    r"misaligned address|CUBLAS_STATUS|CUDNN_STATUS|cudaError"
)
"""What a failure's text holds when the CUDA context it ran in is lost (PyTorch's and the CUDA libraries' errors)."""


class Events:
    """The pytest plugin: a line for each test's start ("start"), each phase that is a call or does not pass
    ("report": when, outcome, seconds, message), and its end ("finish")."""

    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1)
        self.session = None

    def pytest_addoption(self, parser):
        parser.addoption(
            "--stop-at-cuda-error",
            action="store_true",
            help="stop the session after a test whose failure names a CUDA error",
        )

    def pytest_sessionstart(self, session):
        self.session = session

    def write(self, **event) -> None:
        self.file.write(json.dumps({**event, "time": time.time()}) + "\n")
        self.file.flush()

    def pytest_runtest_logstart(self, nodeid, location):
        self.write(event="start", nodeid=nodeid)

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or not report.passed:
            self.write(
                event="report",
                nodeid=report.nodeid,
                when=report.when,
                outcome=report.outcome,
                seconds=report.duration,
                message=_message(report),
            )
        if (
            report.failed
            and self.session.config.getoption("stop_at_cuda_error")
            and CUDA_ERRORS.search(report.longreprtext)
        ):
            self.session.shouldstop = f"{report.nodeid} failed with a CUDA error: the rest runs in a fresh process"

    def pytest_runtest_logfinish(self, nodeid, location):
        self.write(event="finish", nodeid=nodeid)


def _message(report) -> str | None:
    """A failure's one-line cause (as pytest's short summary gives it), a skip's reason, else None."""
    if report.passed:
        return None
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else report.longreprtext
    return text.strip().splitlines()[0][:300] if text.strip() else None


def main(arguments: list[str]) -> int:
    import pytest

    return int(pytest.main(arguments[1:], plugins=[Events(arguments[0])]))


if __name__ == "__main__":
    del sys.path[0]  # the script's folder, which Python puts first: no package root
    sys.exit(main(sys.argv[1:]))
