"""`tapelm tune`: the protocol's grid, extension and choice on hand-made scores; a real tuning at tiny size whose record
agrees with its runs, validates on data apart from the test set, resumes without training again and merges later
encodings; bad input refused in one line before any run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tapelm.cli import main
from tapelm.experiments.evaluate import EVAL_SEED, VALIDATION_SEED
from tapelm.experiments.runs import RESULT_FILE, load_run
from tapelm.experiments.tune import FACTOR, choose, extended, grid, validate

TINY = [
    "--steps",
    "4",
    "--batch-size",
    "8",
    "--warmup",
    "1",
    "--eval-n",
    "4",
    "--eval-every",
    "2",
    "--no-progress",
    "--task-option",
    "max_train_digits=2",
    "--task-option",
    "eval_max_digits=3",
    "--model-option",
    "hidden_size=32",
    "--model-option",
    "intermediate_size=48",
    "--model-option",
    "num_hidden_layers=1",
    "--model-option",
    "num_attention_heads=4",
    "--model-option",
    "num_key_value_heads=4",
]


def test_the_grid_is_the_shared_rate_times_powers_of_the_factor_and_widens_only_at_an_edge() -> None:
    rates = grid(1e-3)
    assert rates == pytest.approx([1e-3 / FACTOR, 1e-3, 1e-3 * FACTOR])
    assert extended(1e-3, rates, rates[1]) is None
    assert extended(1e-3, rates, rates[0]) == pytest.approx([1e-3 / FACTOR**2, *rates])
    assert extended(1e-3, rates, rates[2]) == pytest.approx([*rates, 1e-3 * FACTOR**2])
    wider = extended(1e-3, rates, rates[2])
    assert extended(1e-3, wider, wider[-1]) is None  # one step, once


def test_the_choice_is_the_best_mean_score_then_the_lowest_loss() -> None:
    def runs(*pairs):
        return [{"score": score, "loss": loss} for score, loss in pairs]

    scores = {1.0: runs((0.5, 1.0), (0.7, 1.0)), 2.0: runs((0.55, 2.0), (0.6, 2.0)), 3.0: runs((0.9, 0.1), (0.1, 0.1))}
    assert choose(scores, "accuracy") == 1.0  # means 0.6, 0.575, 0.5
    tied = {1.0: runs((1.0, 0.3)), 2.0: runs((1.0, 0.2))}
    assert choose(tied, "accuracy") == 2.0  # the same score: the lower loss
    tied[3.0] = runs((0.99999, 0.01))
    assert choose(tied, "accuracy") == 3.0  # 0.001 points lower rounds to the same score: its lower loss decides
    tied[3.0] = runs((0.999, 0.01))
    assert choose(tied, "accuracy") == 2.0  # 0.1 points lower is not a tie
    assert choose({1.0: runs((20.0, 3.0)), 2.0: runs((10.0, 2.0))}, "perplexity") == 2.0  # lower is better


@pytest.fixture(scope="module")
def tuned(tmp_path_factory) -> tuple[Path, Path, str]:
    root, out = tmp_path_factory.mktemp("runs"), tmp_path_factory.mktemp("tune")
    args = ["tune", "addition", "--pe", "rope", "--seeds", "100", "--root", str(root), "--out", str(out), *TINY]
    assert main(args) == 0
    return root, out, " ".join(args)


def _record(out: Path) -> dict:
    (path,) = list((out / "addition").glob("*.json"))
    return json.loads(path.read_text())


def test_the_record_holds_every_run_and_the_choice_its_scores_give(tuned) -> None:
    root, out, _ = tuned
    record = _record(out)
    shared = record["shared_lr"]
    entry = record["encodings"]["rope"]
    scores = {float(rate): runs for rate, runs in entry["runs"].items()}
    first = {f"{rate:.4g}" for rate in grid(shared)}
    best_first = choose({rate: runs for rate, runs in scores.items() if f"{rate:.4g}" in first}, record["metric"])
    widened = f"{best_first:.4g}" != f"{shared:.4g}"  # the first grid's best at one of its edges
    rates = sorted(scores)
    assert len(rates) == (4 if widened else 3)  # one step further exactly where the first grid's best is at an edge
    assert f"{entry['lr']:.4g}" == f"{choose(scores, record['metric']):.4g}"
    assert entry["at_edge"] == (widened and f"{entry['lr']:.4g}" in (f"{rates[0]:.4g}", f"{rates[-1]:.4g}"))
    assert record["seeds"] == [100] and record["validation"]["seed"] == VALIDATION_SEED != EVAL_SEED
    assert [p.name for p in (root / "tune" / "addition").iterdir()] == [record["settings_hash"]]
    assert record["train_cpu_seconds"] == pytest.approx(
        sum(run["train_seconds"] for runs in scores.values() for run in runs)
    )
    for rate, runs in scores.items():
        (run,) = runs
        run_dir = root / "tune" / "addition" / record["settings_hash"] / "rope" / f"lr{rate:.4g}-seed100"
        trained = load_run(run_dir)
        assert f"{trained.settings.lr:.4g}" == f"{rate:.4g}" and trained.spec.seed == 100
        assert json.loads((run_dir / "validation.json").read_text())["score"] == run["score"]


def test_validation_is_the_in_distribution_metric_on_data_apart_from_the_test_set(tuned) -> None:
    root, out, _ = tuned
    record = _record(out)
    run_dir = next((root / "tune" / "addition" / record["settings_hash"] / "rope").iterdir())
    run = load_run(run_dir)
    model = run.load_model()
    validation = validate(model, run)
    assert validation == json.loads((run_dir / "validation.json").read_text())
    condition = next(c for c in run.task.eval_conditions() if run.task.in_distribution(c))
    validation_ids = next(iter(run.task.eval_batches(condition, VALIDATION_SEED, 4, 4))).input_ids
    test_ids = next(iter(run.task.eval_batches(condition, EVAL_SEED, 4, 4))).input_ids
    assert not torch.equal(validation_ids, test_ids)
    assert 0.0 <= validation["score"] <= 1.0 and validation["loss"] > 0


def test_a_second_tuning_trains_nothing_again_and_merges_another_encoding(tuned, capsys) -> None:
    root, out, _ = tuned
    before = _record(out)
    finished = {p: p.stat().st_mtime_ns for p in root.glob(f"tune/addition/*/rope/*/{RESULT_FILE}")}
    capsys.readouterr()
    args = ["tune", "addition", "--pe", "rope", "tape", "--seeds", "100", "--root", str(root), "--out", str(out)]
    assert main([*args, *TINY]) == 0
    printed = capsys.readouterr().out
    assert "/ rope /" not in printed and "/ tape /" in printed  # only TAPE's runs train
    assert {p: p.stat().st_mtime_ns for p in finished} == finished
    after = _record(out)
    assert after["encodings"]["rope"] == before["encodings"]["rope"] and "tape" in after["encodings"]
    assert len(after["commands"]) == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["tune", "text", "--pe", "rope"], "task 'text' evaluates on windows of one held-out stream"),
        (["tune", "addition", "--pe", "nonsense"], "unknown encoding 'nonsense'"),
        (["tune", "addition", "--pe", "rope", "--seeds", "-1"], "seeds=[-1] is not allowed"),
    ],
)
def test_bad_input_is_one_line_exit_2_before_any_run(tmp_path, capsys, argv, message) -> None:
    assert main([*argv, "--root", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), *TINY[:10]]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error
    assert not (tmp_path / "runs" / "tune").exists() and not (tmp_path / "out").exists()
