"""How accuracy falls with length (issue 65): the fall per doubling is the least-squares slope against log2 length,
the families are compared paired by seed over their learned members, and the report writes the section and its
figure from an archive."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tapelm.experiments.lengths import by_length, encoding_rows, fall_per_doubling, family_difference, reaches_far
from tapelm.experiments.tasks import get_task
from tapelm.report.lengths_section import build
from tapelm.report.sections import ReportContext

TRAINING = 33
LENGTHS = [TRAINING * m for m in (1, 2, 4, 8, 16)]


MQAR = get_task("mqar", num_keys=128, eval_multipliers=(1, 2, 4, 8, 16))


def result(pe: str, seed: int, curve: dict[int, float], metric: str = "accuracy") -> dict:
    """A finished run's result with its evaluation (as `compare.load_results` gives it): one condition per length."""
    conditions = [{"length": n, "value": v, "n": 100} for n, v in curve.items()]
    return {"pe": pe, "seed": seed, "metric": metric, "evaluation": {"conditions": conditions}}


def write_run(folder, pe: str, seed: int, curve: dict[int, float], metric: str = "accuracy") -> None:
    folder.mkdir(parents=True)
    run = result(pe, seed, curve, metric)
    (folder / "eval.json").write_text(json.dumps(run.pop("evaluation")))
    (folder / "result.json").write_text(json.dumps(run))


def linear(start: float, fall: float) -> dict[int, float]:
    return {n: start + fall * math.log2(n / TRAINING) for n in LENGTHS}


@settings(max_examples=30, deadline=None)
@given(start=st.floats(0.5, 1.0), fall=st.floats(-0.12, 0.0), count=st.integers(2, 5))
def test_the_fall_of_a_curve_linear_in_log_length_is_its_slope(start, fall, count):
    curve = {n: v for n, v in list(linear(start, fall).items())[:count]}
    assert fall_per_doubling(curve) == pytest.approx(fall, abs=1e-12)


def test_a_fall_needs_two_lengths():
    with pytest.raises(ValueError, match="at least two lengths"):
        fall_per_doubling({33: 1.0})


def test_families_are_compared_paired_by_seed_over_learned_members():
    """Each seed's family mean: accumulating members fall 0.10 and 0.06 per doubling (mean 0.08), decaying ones
    0.02, plus a seed effect both share; a decaying encoding that did not learn (0.5 at the training length) is left
    out although it falls fastest."""
    results = {}
    for seed, shared in enumerate((0.0, -0.01, 0.01)):
        for pe, fall in (("tape", -0.10), ("path", -0.06), ("fox", -0.02), ("alibi", -0.02)):
            results.setdefault(pe, {})[seed] = result(pe, seed, linear(1.0, fall + shared))
        results.setdefault("stickbreaking", {})[seed] = result("stickbreaking", seed, linear(0.5, -0.3))
        results.setdefault("rope", {})[seed] = result("rope", seed, linear(1.0, -0.2))
    rows = encoding_rows(MQAR, results)
    assert rows["rope"]["family"] is None and not rows["stickbreaking"]["learned"]
    found = family_difference(rows)
    assert found["members"] == {"accumulating": ["tape", "path"], "decaying": ["fox", "alibi"]}
    assert found["difference"]["mean"] == pytest.approx(-0.06, abs=1e-12)
    assert found["difference"]["half_width"] == pytest.approx(0.0, abs=1e-9)
    assert found["verdict"] == "worse"  # accumulation falls faster


def test_gated_rows_are_their_encodings_family_and_answer_apart():
    """Gated rows join their encoding's family but are compared only with gated rows: ungated, accumulation falls
    0.04 faster; gated, 0.01 slower. The ungated answer restricted to the gated encodings leaves out PaTH, which has
    no gated row."""
    results = {}
    falls = {"tape": -0.10, "path": -0.06, "fox": -0.04, "tape-gated": -0.02, "fox-gated": -0.03, "rope-gated": -0.5}
    for seed in range(3):
        for pe, fall in falls.items():
            results.setdefault(pe, {})[seed] = result(pe, seed, linear(1.0, fall))
    rows = encoding_rows(MQAR, results)
    assert rows["tape-gated"]["family"] == "accumulating" and rows["tape-gated"]["gated"]
    assert rows["rope-gated"]["family"] is None and not rows["tape"]["gated"]
    plain, gated = family_difference(rows), family_difference(rows, gated=True)
    assert plain["members"] == {"accumulating": ["tape", "path"], "decaying": ["fox"]}
    assert plain["difference"]["mean"] == pytest.approx(-0.04, abs=1e-12)
    assert gated["members"] == {"accumulating": ["tape-gated"], "decaying": ["fox-gated"]}
    assert gated["difference"]["mean"] == pytest.approx(0.01, abs=1e-12) and gated["verdict"] == "better"
    matched = family_difference(rows, among={"tape", "fox"})
    assert matched["members"] == {"accumulating": ["tape"], "decaying": ["fox"]}
    assert matched["difference"]["mean"] == pytest.approx(-0.06, abs=1e-12)


@pytest.mark.parametrize("task", [MQAR, get_task("flipflop", eval_multipliers=(1, 2, 4, 8, 16))], ids=lambda t: t.name)
def test_a_length_curve_has_every_evaluated_length_and_holds_the_in_distribution_conditions(task):
    """The conditions drawn as in training but for their length cover every evaluated length, and every
    in-distribution condition is one of them."""
    conditions = task.eval_conditions()
    like_training = [c for c in conditions if task.like_training_but_length(c)]
    assert sorted({c["length"] for c in like_training}) == sorted({c["length"] for c in conditions})
    assert all(task.like_training_but_length(c) for c in conditions if task.in_distribution(c))


def test_flipflop_curves_leave_out_the_sparse_and_dense_splits():
    """A flip-flop run perfect at its training ignore rate at every length but poor on the sparse and dense splits
    learned the task and does not fall: the other splits differ from training in more than length."""
    task = get_task("flipflop", eval_multipliers=(1, 2, 4, 8, 16))
    conditions = [
        {**c, "value": 1.0 if c["split"] == "in_distribution" else 0.5 / c["num_instructions"] ** 0.1, "n": 100}
        for c in task.eval_conditions()
    ]
    run = {"pe": "tape", "seed": 0, "metric": "accuracy", "evaluation": {"conditions": conditions}}
    curve = by_length(task, run)
    assert list(curve) == [129 * m - (m - 1) for m in (1, 2, 4, 8, 16)] and set(curve.values()) == {1.0}
    row = encoding_rows(task, {"tape": {0: run}})["tape"]
    assert row["learned"] and row["fall"]["mean"] == pytest.approx(0.0, abs=1e-12)


def test_only_comparisons_evaluated_at_eight_times_their_length_reach_far():
    assert reaches_far({"task_options": {"eval_multipliers": [1, 2, 4, 8, 16]}})
    assert not reaches_far({"task_options": {"eval_multipliers": [1, 2, 4]}})
    assert not reaches_far({})


def test_the_report_writes_the_section_and_its_figure_from_an_archive(tmp_path):
    folder = tmp_path / "compare" / "mqar" / "abc"
    record = {
        "task": "mqar",
        "settings_hash": "abc",
        "task_options": {"num_keys": 128, "eval_multipliers": [1, 2, 4, 8, 16]},
    }
    (tmp_path / "compare" / "flipflop" / "old").mkdir(parents=True)
    (tmp_path / "compare" / "flipflop" / "old" / "comparison.json").write_text(
        json.dumps({"task": "flipflop", "settings_hash": "old", "task_options": {"eval_multipliers": [1, 2, 4]}})
    )
    text_run = tmp_path / "compare" / "text" / "ppl" / "tape" / "seed0"  # perplexity: no fall in points
    text_run.parents[1].mkdir(parents=True)
    (text_run.parents[1] / "comparison.json").write_text(
        json.dumps({"task": "text", "settings_hash": "ppl", "task_options": {"eval_multipliers": [1, 8]}})
    )
    write_run(text_run, "tape", 0, {64: 30.0, 512: 90.0}, "perplexity")
    folder.mkdir(parents=True)
    (folder / "comparison.json").write_text(json.dumps(record))
    unlearned = tmp_path / "compare" / "mqar" / "far" / "tape" / "seed0"  # no learned member: no answer
    unlearned.parents[1].mkdir(parents=True)
    (unlearned.parents[1] / "comparison.json").write_text(json.dumps({**record, "settings_hash": "far"}))
    write_run(unlearned, "tape", 0, linear(0.4, -0.05))
    for pe, fall in (("tape", -0.1), ("fox", -0.01)):
        for seed in range(3):
            write_run(folder / pe / f"seed{seed}", pe, seed, linear(1.0, fall - 0.01 * seed))
    context = ReportContext(tmp_path, tmp_path / "figures", "figures", tmp_path / "compare")
    text = build(context)
    assert "### mqar (`abc`, trained at 33 tokens)" in text and "flipflop" not in text and "ppl" not in text
    assert "| tape | accumulating | 100.0 ± 0.0 | 89.0 ± 2.5 |" in text
    assert "**accumulation falls faster**" in text and "-9.0 ± 0.0 points" in text
    assert (tmp_path / "figures" / "lengths-mqar-abc.png").stat().st_size > 0
    assert "### mqar (`far`, trained at 33 tokens)" in text and "no answer here" in text
    nothing = ReportContext(tmp_path, tmp_path / "f", "f", tmp_path / "nothing")
    assert build(nothing) is None


def test_a_length_is_labelled_by_its_multiple_of_the_training_size(tmp_path):
    """MQAR trained at 4 pairs (17 tokens) and evaluated at 64 (257 tokens, 15.1 times as long): 16x, as asked."""
    options = {"num_pairs": 4, "eval_multipliers": [1, 2, 4, 8, 16]}
    task = get_task("mqar", **options)
    lengths = [task.sequence_length(4 * m) for m in options["eval_multipliers"]]
    folder = tmp_path / "compare" / "mqar" / "p4"
    folder.mkdir(parents=True)
    (folder / "comparison.json").write_text(
        json.dumps({"task": "mqar", "settings_hash": "p4", "task_options": options})
    )
    for pe in ("tape", "fox"):
        write_run(folder / pe / "seed0", pe, 0, dict.fromkeys(lengths, 1.0))
    context = ReportContext(tmp_path, tmp_path / "figures", "figures", tmp_path / "compare")
    assert "| encoding | family | 1x (17) | 2x (33) | 4x (65) | 8x (129) | 16x (257) |" in build(context)
