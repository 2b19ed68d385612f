"""The law tests in pytest processes, followed as they run (`tapelm doctor`'s tests part).

Each process reports every test's start and result as it happens (pytest_events.py), so the record is current after
each result, and a process that ends mid-test shows which test it was running. The tests marked `own_process` (those
that call Triton kernels, where a CUDA fault corrupts the process's context) run in a few processes of their own, a
test file's tests together, each process stopping after a test that failed with a CUDA error; when one ends before
its tests are done (such an error, a crash, a test past its time), the test it was running fails and the ones it had
not started run on in a fresh process. So a fault fails the test that caused it and no other, at the cost of one
process start per fault, not one per test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

EVENTS_SCRIPT = Path(__file__).with_name("pytest_events.py")
TEST_SECONDS = 180.0
"""The longest one test that runs in a process of its own may take: past it, its process is stopped and the test
fails (a stall), and the others run on in a fresh one."""
POLL_SECONDS = 0.2
ORDER = ("error", "failed", "not run", "skipped", "passed")
"""A test's outcome is its worst phase's (an error is a setup or teardown that failed)."""


@dataclass
class Process:
    """One pytest process: what it runs (`tests`, the node ids when they are known, for a rerun of what remains),
    where its output and events go, and the tests it has started and not finished."""

    name: str
    tests: list[str] | None
    log: Path
    events: Path
    popen: subprocess.Popen
    started: float = field(default_factory=time.monotonic)
    offset: int = 0
    running: dict[str, float] = field(default_factory=dict)
    seen: int = 0


class PytestRun:
    """pytest processes started with `start`, their events read into `results` (node id -> outcome, seconds,
    message) by `poll`, until `wait` finds them all done or the deadline passed."""

    def __init__(self, cwd: Path, folder: Path, deadline: float | None, progress: Callable[[dict], None]):
        self.cwd, self.folder, self.deadline, self.progress = cwd, folder, deadline, progress
        self.results: dict[str, dict] = {}
        self.processes: list[Process] = []
        self.record: list[dict] = []
        folder.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, arguments: list[str], tests: list[str] | None = None, log: Path | None = None) -> None:
        """A pytest process `name` with `arguments` (and `tests`, node ids, first), its output to `log` (default
        FOLDER/NAME.log)."""
        log = log or self.folder / f"{name}.log"
        events = self.folder / f"{name}.jsonl"
        events.write_text("")
        with log.open("w") as output:
            popen = subprocess.Popen(
                [sys.executable, str(EVENTS_SCRIPT), str(events), *(tests or []), *arguments],
                cwd=self.cwd,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.processes.append(Process(name, tests, log, events, popen))

    def wait(self, own_arguments: list[str] | None = None) -> None:
        """Follow every process until all are done: rerun what remains of an own-process one (`own_arguments`) that
        ended early; stop a test past TEST_SECONDS in such a process, and everything at the deadline."""
        while self.processes:
            changed = False
            for process in list(self.processes):
                changed |= self._read(process)
                code = process.popen.poll()
                now = time.monotonic()
                if code is None and self.deadline is not None and now > self.deadline:
                    self._stop(process, "stopped at the deadline")
                    changed = True
                elif code is None and process.tests is not None:
                    if any(now - began > TEST_SECONDS for began in process.running.values()):
                        self._stop(process, f"stopped after {TEST_SECONDS:.0f} s (a stall)")
                        changed = True
                elif code is not None:
                    self._read(process)
                    self._ended(process, code, own_arguments)
                    changed = True
            if changed:
                self.progress(self.summary())
            time.sleep(POLL_SECONDS)

    def _read(self, process: Process) -> bool:
        """Take in the events `process` has written whole since the last read; whether there were any."""
        with process.events.open("rb") as events:
            events.seek(process.offset)
            written = events.read()
        complete = written[: written.rfind(b"\n") + 1]
        process.offset += len(complete)
        for line in complete.decode().splitlines():
            event = json.loads(line)
            test = event["nodeid"]
            if event["event"] == "start":
                process.running[test] = time.monotonic()
                process.seen += 1
            elif event["event"] == "finish":
                process.running.pop(test, None)
            else:
                self._note(
                    test,
                    event["outcome"] if event["when"] == "call" or event["outcome"] != "failed" else "error",
                    event["seconds"],
                    event["message"],
                    process.name,
                )
        return bool(complete)

    def _note(self, test: str, outcome: str, seconds: float, message: str | None, process: str) -> None:
        known = self.results.get(test)
        if known is not None:
            seconds += known["seconds"]
            if ORDER.index(known["outcome"]) < ORDER.index(outcome):
                outcome, message = known["outcome"], known["message"]
        self.results[test] = {"outcome": outcome, "seconds": seconds, "message": message, "process": process}

    def _stop(self, process: Process, why: str) -> None:
        """End `process` (its whole session); the tests it was running fail with `why`."""
        os.killpg(process.popen.pid, signal.SIGKILL)
        process.popen.wait()
        now = time.monotonic()
        for test, began in process.running.items():
            self._note(test, "failed", now - began, f"{why}; its process was ended", process.name)
        process.running.clear()

    def _ended(self, process: Process, code: int, own_arguments: list[str] | None) -> None:
        """`process` ended with `code`: the test it was running fails, and an own-process one's tests it had not
        started run on in a fresh process, unless it started none (then they fail: they cannot start)."""
        self.processes.remove(process)
        for test in process.running:
            self._note(test, "failed", 0.0, f"its process ended (exit {code}) while it ran", process.name)
        self.record.append(
            {
                "name": process.name,
                "exit": code,
                "tests": process.seen,
                "seconds": round(time.monotonic() - process.started, 1),
                "log": process.log.name,
            }
        )
        if process.tests is None:
            return
        remaining = [test for test in process.tests if test not in self.results]
        if not remaining:
            return
        if process.seen == 0 or (self.deadline is not None and time.monotonic() > self.deadline):
            why = (
                "not run: the doctor's deadline passed"
                if process.seen
                else f"not run: its process ended (exit {code}) before starting a test"
            )
            for test in remaining:
                self._note(test, "not run" if process.seen else "error", 0.0, why, process.name)
            return
        base, _, attempt = process.name.partition("+")
        self.start(f"{base}+{int(attempt or 0) + 1}", own_arguments or [], remaining)

    def summary(self) -> dict:
        """Counts, failures (pytest's short-summary lines), every test's outcome, the slowest tests, the tests
        running now and each ended process."""
        counts: dict[str, int] = {}
        for result in self.results.values():
            counts[result["outcome"]] = counts.get(result["outcome"], 0) + 1
        failures = [
            f"{result['outcome'].upper()} {test} - {result['message']}"
            for test, result in self.results.items()
            if result["outcome"] not in ("passed", "skipped")
        ]
        slowest = sorted(self.results.items(), key=lambda item: -item[1]["seconds"])[:20]
        return {
            "counts": counts,
            "failures": failures,
            "outcomes": {test: result["outcome"] for test, result in self.results.items()},
            "slowest": {test: round(result["seconds"], 2) for test, result in slowest},
            "running": sorted(test for process in self.processes for test in process.running),
            "processes": list(self.record),
        }


def collected(cwd: Path, arguments: list[str]) -> tuple[list[str], str | None]:
    """The node ids pytest collects with `arguments`, and the end of its output where collecting failed (else
    None; nothing selected is no failure)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", *arguments], capture_output=True, text=True, cwd=cwd
    )
    failed = done.returncode not in (0, 5)
    return (
        [line.strip() for line in done.stdout.splitlines() if "::" in line],
        (done.stdout + done.stderr)[-1000:] if failed else None,
    )


def lanes(tests: list[str], count: int) -> list[list[str]]:
    """`tests` in at most `count` groups of whole test files, as even in number as whole files allow."""
    files: dict[str, list[str]] = {}
    for test in tests:
        files.setdefault(test.split("::")[0], []).append(test)
    groups: list[list[str]] = [[] for _ in range(min(count, len(files)))]
    for members in sorted(files.values(), key=len, reverse=True):
        min(groups, key=len).extend(members)
    return groups


__all__ = ["TEST_SECONDS", "PytestRun", "collected", "lanes"]
