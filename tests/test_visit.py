"""docs/gpu/visit.sh, the GPU visit's plan, checked on the CPU: with VISIT_DRY_RUN=1 each stage prints its command,
which must parse as a `tapelm` command line, within the time the plan gives it."""

import re
import shlex
import subprocess
from pathlib import Path

from tapelm.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def dry_run(tmp_path, seconds: int, *stages: str, **environment) -> str:
    done = subprocess.run(["bash", "docs/gpu/visit.sh", "run", str(tmp_path / "out"), str(seconds), *stages],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "VISIT_DRY_RUN": "1", **environment})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_next_visit_runs_the_tests_then_every_row_of_bench_speed(tmp_path):
    printed = dry_run(tmp_path, 530, "tests", "speed-1k-all", "science", "compiled-1k",
                      VISIT_TESTS_SECONDS="200", VISIT_TESTS="test_fla")
    assert "== tests (fast paths auto; at most 200 s)" in printed
    assert "== speed-1k-all (fast paths auto; at most 530 s)" in printed  # a dry stage takes no time
    assert "== compiled-1k" in printed  # 270 s fit in what is left
    commands = [line.split(maxsplit=1)[1] for line in printed.splitlines() if line.startswith("python3 -m ")]
    assert len(commands) == 4, printed
    parser = build_parser()
    for command in commands:
        words = shlex.split(command)
        if words[:2] == ["-m", "tapelm.cli"]:
            parser.parse_args(words[2:])
    doctor, speed, stage = (shlex.split(command)[2:] for command in commands[:3])
    assert doctor[:1] == ["doctor"] and doctor[doctor.index("--select") + 1] == "test_fla"
    rows = speed[speed.index("--pe") + 1:]
    from tapelm import PE_TYPES

    assert set(PE_TYPES) | {"llama", "fla-fox", "fla-path"} <= set(rows) and rows[:2] == ["rope", "tape"]
    assert stage[:1] == ["stage"] and int(stage[stage.index("--budget-seconds") + 1]) == 530 - 25


def test_a_stage_that_cannot_finish_is_not_started(tmp_path):
    printed = dry_run(tmp_path, 100, "tests", "compiled-1k")
    assert re.search(r"== tests: skipped, \d+ s left of the visit, the stage may take 150 s", printed)
    assert re.search(r"== compiled-1k: skipped, \d+ s left", printed)
    assert "python3 -m" not in printed
