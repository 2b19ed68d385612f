"""How accuracy falls with length (issue 65): the fall per doubling is the least-squares slope against log2 length,
the families are compared paired by seed over their learned members, and the report writes the section and its
figure from an archive."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tapelm.experiments.lengths import encoding_rows, fall_per_doubling, family_difference, reaches_far
from tapelm.report.lengths_section import build, build_readme
from tapelm.report.sections import ReportContext

TRAINING = 33
LENGTHS = [TRAINING * m for m in (1, 2, 4, 8, 16)]


def result(pe: str, seed: int, curve: dict[int, float], metric: str = "accuracy") -> dict:
    return {"pe": pe, "seed": seed, "metric": metric, "summary": {"by_length": {str(n): v for n, v in curve.items()}}}


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
    rows = encoding_rows("mqar", results)
    assert rows["rope"]["family"] is None and not rows["stickbreaking"]["learned"]
    found = family_difference(rows)
    assert found["members"] == {"accumulating": ["tape", "path"], "decaying": ["fox", "alibi"]}
    assert found["difference"]["mean"] == pytest.approx(-0.06, abs=1e-12)
    assert found["difference"]["half_width"] == pytest.approx(0.0, abs=1e-9)
    assert found["verdict"] == "worse"  # accumulation falls faster


def test_only_comparisons_evaluated_at_eight_times_their_length_reach_far():
    assert reaches_far({"task_options": {"eval_multipliers": [1, 2, 4, 8, 16]}})
    assert not reaches_far({"task_options": {"eval_multipliers": [1, 2, 4]}})
    assert not reaches_far({})


def test_the_report_writes_the_section_and_its_figure_from_an_archive(tmp_path):
    folder = tmp_path / "compare" / "mqar" / "abc"
    record = {"task": "mqar", "settings_hash": "abc", "task_options": {"eval_multipliers": [1, 2, 4, 8, 16]}}
    (tmp_path / "compare" / "flipflop" / "old").mkdir(parents=True)
    (tmp_path / "compare" / "flipflop" / "old" / "comparison.json").write_text(
        json.dumps({"task": "flipflop", "settings_hash": "old", "task_options": {"eval_multipliers": [1, 2, 4]}})
    )
    text_run = tmp_path / "compare" / "text" / "ppl" / "tape" / "seed0"  # perplexity: no fall in points
    text_run.mkdir(parents=True)
    (text_run.parents[1] / "comparison.json").write_text(
        json.dumps({"task": "text", "settings_hash": "ppl", "task_options": {"eval_multipliers": [1, 8]}})
    )
    (text_run / "result.json").write_text(json.dumps(result("tape", 0, {64: 30.0, 512: 90.0}, "perplexity")))
    (text_run / "eval.json").write_text("{}")
    folder.mkdir(parents=True)
    (folder / "comparison.json").write_text(json.dumps(record))
    unlearned = tmp_path / "compare" / "mqar" / "far" / "tape" / "seed0"  # no learned member: no answer
    unlearned.mkdir(parents=True)
    (unlearned.parents[1] / "comparison.json").write_text(json.dumps({**record, "settings_hash": "far"}))
    (unlearned / "result.json").write_text(json.dumps(result("tape", 0, linear(0.4, -0.05))))
    (unlearned / "eval.json").write_text("{}")
    for pe, fall in (("tape", -0.1), ("fox", -0.01)):
        for seed in range(3):
            run = folder / pe / f"seed{seed}"
            run.mkdir(parents=True)
            (run / "result.json").write_text(json.dumps(result(pe, seed, linear(1.0, fall - 0.01 * seed))))
            (run / "eval.json").write_text("{}")
    context = ReportContext(tmp_path, tmp_path / "figures", "figures", tmp_path / "compare")
    text = build(context)
    assert "### mqar (`abc`, trained at 33 tokens)" in text and "flipflop" not in text and "ppl" not in text
    assert "| tape | accumulating | 100.0 ± 0.0 | 89.0 ± 2.5 |" in text
    assert "**accumulation falls faster**" in text and "-9.0 ± 0.0 points" in text
    assert (tmp_path / "figures" / "lengths-mqar-abc.png").stat().st_size > 0
    short = build_readme(context)
    assert "| mqar (`abc`) | family | at 33 tokens | at 528 (16x) | fall per doubling | seeds |" in short
    assert "| tape | accumulating | 100.0 ± 0.0 | 56.0 ± 9.9 | -11.0 ± 2.5 | 3 |" in short
    assert "**accumulation falls faster**.\n\nWithout an answer" in short and "| mqar (`far`)" not in short
    assert short.endswith("tables in docs/RESULTS.md): mqar (`far`).")
    assert "### mqar (`far`, trained at 33 tokens)" in text and "no answer here" in text
    nothing = ReportContext(tmp_path, tmp_path / "f", "f", tmp_path / "nothing")
    assert build(nothing) is None and build_readme(nothing) is None
