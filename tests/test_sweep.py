"""`tapelm sweep`: a grid of encodings, seeds, learning rates and schedules, each run cached, curves in one JSON."""

from __future__ import annotations

import json

import pytest

from tapelm.cli import main

TINY = [
    "--steps",
    "4",
    "--eval-every",
    "2",
    "--log-every",
    "1",
    "--batch-size",
    "4",
    "--warmup",
    "1",
    "--eval-n",
    "2",
    "--no-progress",
    "--task-option",
    "max_train_digits=2",
    "--task-option",
    "eval_max_digits=2",
    "--model-option",
    "hidden_size=16",
    "--model-option",
    "intermediate_size=24",
    "--model-option",
    "num_hidden_layers=2",
    "--model-option",
    "num_attention_heads=2",
    "--model-option",
    "num_key_value_heads=2",
]


def test_sweep_runs_every_cell_once_and_records_its_curve(tmp_path, capsys) -> None:
    args = [
        "sweep",
        "addition",
        "--pe",
        "tape",
        "rope",
        "--seeds",
        "0",
        "1",
        "--lr",
        "1e-3",
        "--schedule",
        "constant",
        "cosine",
        "--root",
        str(tmp_path / "runs"),
        "--out",
        str(tmp_path / "out"),
        *TINY,
    ]
    assert main(args) == 0
    record = json.loads((tmp_path / "out" / "addition-tape-rope-sweep.json").read_text())
    cells = {(e["pe"], e["seed"], e["lr"], e["schedule"]) for e in record["runs"].values()}
    assert cells == {
        (pe, seed, 1e-3, schedule) for pe in ("tape", "rope") for seed in (0, 1) for schedule in ("constant", "cosine")
    }
    assert all([step for step, _ in e["curve"]["in_distribution"]] == [2, 4] for e in record["runs"].values())
    assert all((tmp_path / "runs" / e["run_dir"] / "result.json").is_file() for e in record["runs"].values())
    assert str(tmp_path) not in json.dumps(record)  # the cache's folder is the user's: no absolute path
    assert (tmp_path / "out" / "addition-tape-rope-sweep.png").stat().st_size > 0
    # Every cell is its own run: no two share a loss curve (2 layers, so TAPE has update weights to train).
    losses = {tuple(v for _, v in e["curve"]["loss"]) for e in record["runs"].values()}
    assert len(losses) == 8
    assert record["command"].startswith("tapelm sweep addition --pe tape rope --seeds 0 1 --lr 0.001 --schedule")
    capsys.readouterr()
    assert main([*args, "--name", "again"]) == 0  # cached: nothing is trained again, the same curves come back
    assert "to run" not in capsys.readouterr().out
    again = json.loads((tmp_path / "out" / "again.json").read_text())
    assert {k: v["curve"] for k, v in again["runs"].items()} == {k: v["curve"] for k, v in record["runs"].items()}


@pytest.mark.parametrize(
    "flag, value, message",
    [("--schedule", "linear", "--schedule 'linear' is not allowed"), ("--pe", "rotary", "unknown encoding 'rotary'")],
)
def test_sweep_refuses_bad_input_before_any_run(tmp_path, capsys, flag, value, message) -> None:
    args = ["sweep", "addition", "--lr", "1e-3", flag, value, "--root", str(tmp_path / "runs"), *TINY]
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
