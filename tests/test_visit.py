"""docs/gpu/visit.sh, the GPU visit's plan, checked on the CPU: with VISIT_DRY_RUN=1 each stage prints its command,
which must parse as a `tapelm` command line, and counts as taking all of its limit, so the dry run shows the worst
case: which stages the call's seconds hold."""

import re
import shlex
import subprocess
from pathlib import Path

from tapelm.cli import build_parser
from tapelm.fast_paths import PATHS

ROOT = Path(__file__).resolve().parents[1]
PLAN = [
    "tests",
    "first-calls",
    "first-calls-again",
    "speed-1k-defaults",
    "speed-1k-kernels",
    "speed-1k-efficient",
    "speed-1k-every",
    "sharing",
    "speed-1k-grape",
    "speed-1k-new",
    "science",
]
FILLING = PLAN[:-4]  # the stages whose limits fill the call; the sharing measurement, GRAPE's and the new encodings'
# rows and the science run on what they leave


def dry_run(tmp_path, seconds: int, *stages: str, **environment) -> str:
    done = subprocess.run(
        ["bash", "docs/gpu/visit.sh", "run", str(tmp_path / "out"), str(seconds), *stages],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "VISIT_DRY_RUN": "1", **environment},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def stages(printed: str) -> dict[str, int | None]:
    """Each stage the run named: the seconds it may take, or None where it was skipped."""
    found = {}
    for line in printed.splitlines():
        started = re.match(r"== (\S+) \(fast paths \S+; at most (\d+) s\)", line)
        skipped = re.match(r"== (\S+): skipped", line)
        if started:
            found[started[1]] = int(started[2])
        elif skipped:
            found[skipped[1]] = None
    return found


def commands(printed: str) -> dict[str, list[str]]:
    """Each stage's command (its words after `python3 -m tapelm.cli`)."""
    found, stage = {}, None
    for line in printed.splitlines():
        if line.startswith("== ") and "at most" in line:
            stage = line.split()[1]
        elif line.startswith("python3 -m tapelm.cli "):
            found[stage] = shlex.split(line)[3:]
    return found


def test_the_next_visit_runs_every_stage_within_one_call_of_nine_minutes(tmp_path):
    """The plan in 530 s (a 540 s call with the start of the script): the tests, the first calls and every speed stage
    at their limits fit; the science takes what they leave (here, at the worst, too little to start)."""
    printed = dry_run(tmp_path, 530, "next")
    budgets = stages(printed)
    assert list(budgets) == PLAN
    assert None not in [budgets[stage] for stage in FILLING] and sum(budgets[stage] for stage in FILLING) <= 530
    assert budgets["tests"] <= 120 and budgets["sharing"] is None and budgets["speed-1k-grape"] is None
    assert budgets["speed-1k-new"] is None and budgets["science"] is None
    parser = build_parser()
    found = commands(printed)
    for words in found.values():
        parser.parse_args(words)
    doctor = found["tests"]
    assert doctor[:1] == ["doctor"] and int(doctor[doctor.index("--seconds") + 1]) <= budgets["tests"] - 20
    assert "first-calls" in doctor[doctor.index("--skip") :]
    for stage in ("first-calls", "first-calls-again"):  # the second in a process that finds the first's caches
        assert found[stage][found[stage].index("--skip") + 1 :] == ["tests", "speed", "training", "generation"]
        assert found[stage][found[stage].index("--out") + 1].endswith(stage)


def test_the_speed_stages_measure_the_issues_rows_on_their_paths(tmp_path):
    found = commands(dry_run(tmp_path, 530, "next"))

    def rows_and_paths(stage):
        words = found[stage]
        paths = words[words.index("--fast-paths") + 1 : words.index("--no-progress")]
        return words[words.index("--pe") + 1 :], set(paths)

    defaults = {path.name for path in PATHS for encoding in ("rope", "tape") if path.verified_for("cuda", encoding)}
    assert rows_and_paths("speed-1k-defaults") == (
        ["rope", "tape", "t5", "fire", "cope", "fox", "path", "fla-fox", "fla-path"],
        {"auto"},
    )
    assert rows_and_paths("speed-1k-kernels") == (
        ["rope", "tape", "fox", "path"],
        defaults | {"state-update-triton", "forgetting-attention-fla", "path-attention-fla"},
    )
    assert rows_and_paths("speed-1k-efficient") == (["rope", "t5", "fire", "cope"], defaults | {"attention-efficient"})
    assert rows_and_paths("speed-1k-every") == (["rope", "tape"], {"on"})


def test_the_science_takes_what_the_other_stages_leave(tmp_path):
    printed = dry_run(tmp_path, 1000, "next")
    budgets = stages(printed)
    assert budgets["science"] == 1000 - sum(budgets[stage] for stage in PLAN[:-1])
    grape = commands(printed)["speed-1k-grape"]
    assert grape[grape.index("--pe") + 1 :] == ["rope", "grape-m-fixed", "grape-m", "grape-ap"]
    new = commands(printed)["speed-1k-new"]
    assert new[new.index("--pe") + 1 :] == [
        "rope",
        "pope",
        "wall",
        "stickbreaking",
        "grape-a-q",
        "grape-a-k",
        "grape-a-qk",
    ]
    sharing = commands(printed)["sharing"]
    build_parser().parse_args(sharing)
    assert sharing[: sharing.index("--root")] == [
        *("sharing", "mqar", "--pe", "tape", "--runs", "1", "2", "4", "--steps", "150", "--device", "0")
    ]
    science = commands(printed)["science"]
    assert science[:1] == ["stage"] and int(science[science.index("--budget-seconds") + 1]) == budgets["science"] - 25


def test_a_stage_that_cannot_finish_is_not_started(tmp_path):
    printed = dry_run(tmp_path, 100, "tests", "compiled-1k")
    assert re.search(r"== tests: skipped, \d+ s left of the visit, the stage may take 120 s", printed)
    assert re.search(r"== compiled-1k: skipped, \d+ s left", printed)
    assert "python3 -m" not in printed
