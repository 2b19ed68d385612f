"""`tapelm tune`: the protocol's grid, extension and choice on hand-made scores; a real tuning at tiny size whose record
agrees with its runs, validates on data apart from the test set, resumes without training again and merges later
encodings; bad input refused in one line before any run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import TINY_ADDITION as TINY
from tapelm.cli import main
from tapelm.experiments.evaluate import EVAL_SEED, VALIDATION_SEED
from tapelm.experiments.runs import RESULT_FILE, load_run
from tapelm.experiments.tune import FACTOR, choose, extended, grid, validate


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
        (["tune", "addition", "--pe", "nonsense"], "unknown encoding 'nonsense'"),
        (["tune", "addition", "--pe", "rope", "--seeds", "-1"], "seeds=[-1] is not allowed"),
    ],
)
def test_bad_input_is_one_line_exit_2_before_any_run(tmp_path, capsys, argv, message) -> None:
    assert main([*argv, "--root", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), *TINY[:10]]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error
    assert not (tmp_path / "runs" / "tune").exists() and not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def tuned_comparison(tmp_path_factory) -> tuple[Path, Path, dict]:
    """The shared-rate comparison of TAPE and RoPE, then the comparison at tuned rates from a tuning record that
    chose the shared rate for RoPE and three times it for TAPE (written as `tapelm tune` writes it)."""
    root, out = tmp_path_factory.mktemp("runs"), tmp_path_factory.mktemp("tune")
    pes = ["tape", "rope", "randpe", "nope", "fire"]  # the arithmetic claim's encodings
    assert main(["compare", "addition", "--pe", *pes, "--seeds", "0", "1", "--root", str(root), *TINY]) == 0
    (shared,) = list((root / "compare" / "addition").iterdir())
    lr = json.loads((shared / "comparison.json").read_text())["train"]["lr"]
    record = {
        "task": "addition",
        "settings_hash": shared.name,
        "encodings": {**{pe: {"lr": lr} for pe in pes}, "tape": {"lr": 3 * lr}},
    }
    (out / "addition").mkdir()
    (out / "addition" / f"{shared.name}.json").write_text(json.dumps(record))
    tuned = [
        "compare",
        "addition",
        "--pe",
        *pes,
        "--seeds",
        "0",
        "1",
        "--root",
        str(root),
        "--tuned",
        str(out),
    ]
    assert main([*tuned, *TINY]) == 0
    return root, out, {"shared": shared, "tuned": shared.with_name(shared.name + "-tuned"), "lr": lr, "argv": tuned}


def test_the_tuned_comparison_trains_each_encoding_at_its_rate_and_reuses_the_shared_rates_runs(
    tuned_comparison,
) -> None:
    root, _, found = tuned_comparison
    shared, tuned, lr = found["shared"], found["tuned"], found["lr"]
    record = json.loads((tuned / "comparison.json").read_text())
    assert record["rates"] == {"tape": 3 * lr, "rope": lr, "randpe": lr, "nope": lr, "fire": lr}
    assert record["train"]["lr"] == lr
    assert record["settings_hash"] == tuned.name and "--tuned" in record["commands"][0]
    for seed in (0, 1):
        tape = json.loads((tuned / "tape" / f"seed{seed}" / RESULT_FILE).read_text())
        assert tape["identity"]["train"]["lr"] == pytest.approx(3 * lr) and tape["identity"]["seed"] == seed
        rope = tuned / "rope" / f"seed{seed}"
        assert (rope / RESULT_FILE).read_bytes() == (shared / "rope" / f"seed{seed}" / RESULT_FILE).read_bytes()
        assert not (rope / "model").exists()  # copied from the shared comparison, not trained again
    shared_record = json.loads((shared / "comparison.json").read_text())
    assert "rates" not in shared_record and shared_record["runs"] == {
        pe: [0, 1] for pe in ("tape", "rope", "randpe", "nope", "fire")
    }


def test_the_report_shows_both_verdicts_and_keeps_tuned_comparisons_out_of_the_claims(tuned_comparison, tmp_path):
    root, _, found = tuned_comparison
    from tapelm.report import build_report

    out, readme = tmp_path / "docs" / "RESULTS.md", tmp_path / "README.md"
    readme.write_text("<!-- tapelm-report:begin at-a-glance -->\n<!-- tapelm-report:end at-a-glance -->\n")
    assert "tuned-rates" in build_report(root, out, readme=readme)
    assert f"| addition (6 steps, `{found['tuned'].name}`) |" in readme.read_text()  # the first screen: tuned rates
    text = out.read_text()
    section = text.split("<!-- tapelm-report:begin tuned-rates -->")[1].split("<!-- tapelm-report:end")[0]
    assert f"at tuned rates (`{found['tuned'].name}`)" in section
    assert f"TAPE's rate: {3 * found['lr']:.3g} (x3)." in section
    assert f"| RoPE | {found['lr']:.3g} (x1) |" in section
    claims = text.split("<!-- tapelm-report:begin claims -->")[1].split("<!-- tapelm-report:end claims -->")[0]
    assert found["tuned"].name not in claims and found["shared"].name in claims
    from tapelm.experiments.claims import CLAIMS

    (addition,) = [claim for claim in CLAIMS if claim.name == "arithmetic"]
    row = next(line for line in claims.splitlines() if line.startswith(f"| {addition.statement} |"))
    assert row.split(" | ")[-1].strip(" |").startswith("**")  # the claim judged at tuned rates
    assert "The paper's claim (arithmetic): **" in section and "at tuned rates (" in section


def test_a_claim_is_not_judged_at_tuned_rates_over_fewer_of_its_encodings(tuned_comparison, tmp_path) -> None:
    """A tuned comparison without some of a claim's baselines leaves the claim unjudged there, saying which."""
    root, _, found = tuned_comparison
    from tapelm.report import build_report

    copy = tmp_path / "runs"
    shutil.copytree(root, copy)
    shutil.rmtree(copy / "compare" / "addition" / found["tuned"].name / "fire")
    out = tmp_path / "docs" / "RESULTS.md"
    build_report(copy, out)
    text = out.read_text()
    assert "| not yet (fire not tuned) |" in text
    assert "not judged at tuned rates until fire are tuned and trained there" in text


def test_a_tuned_comparison_refuses_runs_trained_at_another_rate_and_encodings_not_tuned(
    tuned_comparison, capsys
) -> None:
    root, out, found = tuned_comparison
    path = out / "addition" / f"{found['shared'].name}.json"
    record = json.loads(path.read_text())
    try:
        path.write_text(json.dumps({**record, "encodings": {**record["encodings"], "tape": {"lr": found["lr"] / 3}}}))
        before = (found["tuned"] / "comparison.json").read_text()
        capsys.readouterr()
        assert main([*found["argv"], *TINY]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and "was trained with other settings (different train)" in error
        assert (found["tuned"] / "comparison.json").read_text() == before
    finally:
        path.write_text(json.dumps(record))
    seeds = found["argv"].index("--seeds")
    argv = [*found["argv"][:3], "t5", *found["argv"][seeds:]]
    assert main([*argv, *TINY]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "encoding 't5' is not tuned for addition" in error


def test_text_without_room_for_a_validation_set_apart_from_its_test_set_is_refused(tmp_path, capsys) -> None:
    """Text tunes on a span of its held-out stream apart from the test set's; a stream too short for one is refused
    in one line before any run."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(41):
        (corpus / f"f{i:03d}.txt").write_text(f"file{i:03d}marker\n" + " ".join(f"w{j % 13}" for j in range(60)))
    text = ["--task-option", f"corpus={corpus}", "--task-option", "train_length=32", "--task-option", "tokenizer=byte"]
    argv = ["tune", "text", "--pe", "rope", "--root", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]
    assert main([*argv, *text, "--steps", "2", "--eval-n", "1000"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "no room for a validation set of 1000 examples apart from its test set" in error
    assert not (tmp_path / "runs").exists()
