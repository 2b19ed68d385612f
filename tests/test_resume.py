"""Runs that resume: checkpoints every few minutes of training (`checkpoint_minutes`, outside a run's identity), and a
run that a signal, a deadline or a preemption stops mid-way resumed from its newest checkpoint to the unbroken run's
result, bit for bit on the CPU; the stage's estimate of what a resumed run has left. Preemption through submitit:
tests/test_launchers.py."""

from __future__ import annotations

import json
import signal
from dataclasses import replace
from pathlib import Path

import pytest

from tapelm.cli import main
from tapelm.experiments.plan import AT_GPU_SCALE
from tapelm.experiments.presets import PRESETS, get_preset
from tapelm.experiments.runs import RESULT_FILE, RunOptions, RunSpec, batch_stream, resolve, run_task
from tapelm.experiments.stage import _open, ordered_runs, run_stage, whole_run_seconds
from tapelm.training.checkpoints import list_checkpoints, verify_checkpoint
from tapelm.training.loop import LoopOptions, train
from test_stage import TEXT, TINY, schedule

SPEC = RunSpec(
    task="addition",
    pe="tape",
    task_options={"max_train_digits": 3, "eval_max_digits": 4},
    model_options={
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    train_options={"steps": 12, "batch_size": 8, "warmup": 2, "log_every": 2, "lr": 3e-3, "keep_last": 2},
    eval_n=4,
    eval_batch_size=64,
)
EVERY_LOG_STEP = 1e-9  # minutes: every log step is past the cadence
TIMINGS = ("tokens_per_s", "elapsed_s")


class Stopped(Exception):
    """What the signal handler of these tests raises: the process stops wherever it was."""


def metric_lines(run_dir: Path) -> list[dict]:
    """Every metric line of a run without its timings."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k not in TIMINGS} for line in lines]


def weights(run_dir: Path) -> bytes:
    return (run_dir / "model" / "model.safetensors").read_bytes()


def test_a_run_a_signal_stops_resumes_from_its_timed_checkpoint_to_the_unbroken_run(tmp_path) -> None:
    """A signal arrives while step 9's batch is made: the checkpoints every log step (2, 4, 6, 8; two kept) leave
    step 8 to resume from; the resumed run's losses, metric lines and final weights are the unbroken run's, which
    wrote no checkpoint before its end (an hour's cadence)."""
    run = resolve(SPEC)
    stream = batch_stream(run.task, 0, run.settings.batch_size)

    def fit(directory, minutes, make=stream, resume=False):
        return train(
            run.build_model(),
            make,
            run.settings,
            directory,
            resume=resume,
            options=LoopOptions(progress=False, checkpoint_minutes=minutes),
        )

    whole = fit(tmp_path / "whole", 60.0)
    assert [step for step, _ in list_checkpoints(tmp_path / "whole")] == [12]

    def signalled(index: int) -> dict:
        if index == 8:
            signal.raise_signal(signal.SIGUSR1)
        return stream(index)

    def stop(signum, frame):
        raise Stopped

    previous = signal.signal(signal.SIGUSR1, stop)
    try:
        with pytest.raises(Stopped):
            fit(tmp_path / "cut", EVERY_LOG_STEP, signalled)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert [step for step, _ in list_checkpoints(tmp_path / "cut")] == [6, 8]
    resumed = fit(tmp_path / "cut", 0.0, resume=True)
    assert resumed.start_step == 8 and resumed.losses == whole.losses[8:]
    assert metric_lines(tmp_path / "cut") == metric_lines(tmp_path / "whole")
    assert weights(tmp_path / "cut") == weights(tmp_path / "whole")


def test_a_task_run_stopped_after_its_timed_checkpoints_resumes_to_the_same_result(tmp_path) -> None:
    """`run_task`, as a stage runs it: stopped after step 5 (a deadline), resumed from step 4 with the recipe's
    cadence; result, evaluation, metric lines, weights and run.json are the
    unbroken run's."""
    options = RunOptions(progress=False)
    whole = run_task(SPEC, tmp_path / "whole", options)
    cut = tmp_path / "cut"
    timed = RunOptions(progress=False, checkpoint_minutes=EVERY_LOG_STEP)
    assert run_task(SPEC, cut, timed, stop_after=5) is None
    assert [step for step, _ in list_checkpoints(cut)] == [2, 4] and not (cut / RESULT_FILE).exists()
    recorded = verify_checkpoint(list_checkpoints(cut)[-1][1])["train_seconds"]
    resumed = run_task(SPEC, cut, options, resume=True)
    assert (whole["resumed_from_step"], resumed["resumed_from_step"]) == (0, 4)
    assert (whole["train_seconds_before_this_session"], resumed["train_seconds_before_this_session"]) == (0, recorded)
    assert recorded > 0
    for key in ("summary", "mean", "final_loss", "first_loss", "settings_hash", "identity"):
        assert resumed[key] == whole[key], key
    assert 0 < resumed["tokens_this_session"] < whole["tokens_this_session"]
    assert metric_lines(cut) == metric_lines(tmp_path / "whole")
    assert weights(cut) == weights(tmp_path / "whole")
    assert (cut / "eval.json").read_bytes() == (tmp_path / "whole" / "eval.json").read_bytes()
    assert (cut / "run.json").read_bytes() == (tmp_path / "whole" / "run.json").read_bytes()


def test_the_gpu_recipes_checkpoint_every_few_minutes_outside_their_identity() -> None:
    """Every GPU recipe checkpoints on a clock and the laptop recipes do not; the cadence is no part of the settings
    that name a comparison, so the planned GPU comparisons keep their hashes (docs/plans.json, the archive)."""
    for owed in AT_GPU_SCALE:
        preset = get_preset("gpu", owed.task)
        assert 0 < preset.checkpoint_minutes <= 5, owed.task
        assert "checkpoint_minutes" not in json.dumps(resolve(owed.spec()).identity)
    assert all(preset.checkpoint_minutes == 0 for preset in PRESETS["cpu-small"].values())


def test_bad_checkpoint_minutes_are_one_line_errors_before_anything_starts(tmp_path, capsys) -> None:
    for bad in (-1, float("nan"), True, "3"):
        with pytest.raises(ValueError, match=r"^checkpoint_minutes=.*: give minutes >= 0 \(0: no timed checkpoints\)$"):
            RunOptions(checkpoint_minutes=bad)
    out = tmp_path / "run"
    argv = ["train", "--task", "addition", "--pe", "rope", "--out", str(out), "--checkpoint-minutes", "-2"]
    assert main(argv) == 2
    assert "error: --checkpoint-minutes=-2.0: give minutes >= 0" in capsys.readouterr().err
    assert not out.exists()
    assert main(["stage", "--budget-seconds", "60", "--out", str(out), "--checkpoint-minutes", "-1", "--dry-run"]) == 2
    assert "error: --checkpoint-minutes=-1.0: give minutes >= 0" in capsys.readouterr().err


def test_the_stage_expects_a_resumed_run_to_take_the_share_of_its_steps_left() -> None:
    """A run stopped at step 600 of 2,400 is expected to take three quarters of a whole run, and says so; a run
    that resumed is counted whole: its last session's seconds plus the training its checkpoint recorded."""
    plan = schedule((0, "rope", 0, 100.0, True))
    tape = next(r for r in plan.runs if (r.comparison, r.pe, r.seed) == (0, "tape", 0))
    whole, _ = plan.expected(tape)
    tape.resumes_from, tape.left = 600, 0.75
    seconds, basis = plan.expected(tape)
    assert seconds == pytest.approx(0.75 * whole) and basis.endswith(
        "; 75% of it left after its checkpoint at step 600"
    )
    assert plan.minutes_left() < schedule((0, "rope", 0, 100.0, True)).minutes_left()
    result = {"session_seconds": 130.0, "train_seconds_before_this_session": 30.0}
    assert whole_run_seconds(result) == 160.0
    assert whole_run_seconds({"session_seconds": 130.0}) == 130.0  # written before results recorded it
    assert ordered_runs(AT_GPU_SCALE[:1])[0].left == 1.0


def test_the_next_stage_resumes_a_run_a_deadline_stopped_and_ends_it_as_an_unbroken_one(tmp_path) -> None:
    """A stage stopped while RoPE's seed 0 trained (its folder holds checkpoints of steps 2 and 4, no result); the
    next stage in the same root resumes it, says so in stage.json, and its results equal a stage's that ran it
    unbroken in another root."""
    pair = replace(TEXT, rows=("rope", "tape"), seeds=1)
    overrides = {**TINY, "train_options": {**TINY["train_options"], "steps": 6, "eval_every": 3, "log_every": 2}}
    comparison = _open(pair, overrides, tmp_path / "runs", None)
    stopped = comparison.run_dir("rope", 0)
    timed = RunOptions(progress=False, checkpoint_minutes=EVERY_LOG_STEP)
    assert run_task(comparison.runs["rope", 0], stopped, timed, resume=True, stop_after=5) is None
    assert [step for step, _ in list_checkpoints(stopped)] == [2, 4]
    for name, root in (("resumed", tmp_path / "runs"), ("unbroken", tmp_path / "elsewhere")):
        assert run_stage(3600, tmp_path / name, (pair,), root=root, overrides=overrides, progress=False) == 0
    resumed, unbroken = (
        json.loads((tmp_path / name / "stage.json").read_text())["runs"] for name in ("resumed", "unbroken")
    )
    assert resumed[0]["pe"] == "rope" and resumed[0]["resumes_from_step"] == 4
    assert resumed[0]["expected_from"].endswith("; 33% of it left after its checkpoint at step 4")
    assert "resumes_from_step" not in unbroken[0] and "resumes_from_step" not in resumed[1]
    for pe in ("rope", "tape"):
        folders = [
            next((tmp_path / name / "compare" / "text").iterdir()) / pe / "seed0" for name in ("resumed", "unbroken")
        ]
        assert metric_lines(folders[0]) == metric_lines(folders[1])
        results = [json.loads((folder / RESULT_FILE).read_text()) for folder in folders]
        assert [r["resumed_from_step"] for r in results] == ([4, 0] if pe == "rope" else [0, 0])
        assert results[0]["summary"] == results[1]["summary"] and results[0]["final_loss"] == results[1]["final_loss"]
