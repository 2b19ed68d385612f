"""Across-seed statistics and the claims' verdicts, on hand-worked numbers."""

from __future__ import annotations

import math

import pytest

from tapelm.analysis.statistics import interval, paired_difference, proportion_error, verdict
from tapelm.experiments.claims import CLAIMS, judge


def test_interval_is_the_t_interval_of_the_mean():
    result = interval([1.0, 2.0, 3.0])
    assert result["mean"] == 2.0 and result["std"] == 1.0 and result["n"] == 3
    assert result["half_width"] == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6)  # t(0.975, 2) = 4.3027
    assert math.isnan(interval([5.0])["half_width"]) and interval([5.0])["mean"] == 5.0
    assert interval([None, float("nan")])["n"] == 0


def test_paired_difference_uses_the_shared_seeds_only():
    result = paired_difference({0: 0.9, 1: 0.8, 2: 0.7, 5: 0.1}, {0: 0.5, 1: 0.6, 2: 0.3, 3: 0.0})
    assert result["seeds"] == [0, 1, 2]
    assert result["mean"] == pytest.approx((0.4 + 0.2 + 0.4) / 3)


@pytest.mark.parametrize(
    ("mean", "half", "higher", "expected"),
    [
        (0.05, 0.02, True, "better"),
        (-0.05, 0.02, True, "worse"),
        (0.01, 0.02, True, "no difference shown"),
        (0.05, 0.02, False, "worse"),
        (-0.05, 0.02, False, "better"),  # perplexity: lower is better
    ],
)
def test_verdict_reads_the_interval_in_the_metric_direction(mean, half, higher, expected):
    assert verdict({"mean": mean, "half_width": half, "n": 3}, higher) == expected
    assert verdict({"mean": mean, "half_width": float("nan"), "n": 1}, higher) == "too few seeds"


def test_proportion_error():
    assert proportion_error(0.5, 100) == pytest.approx(0.05)
    assert proportion_error(1.0, 100) == 0.0 and math.isnan(proportion_error(0.5, 0))


def summary_with(in_distribution: dict[str, float], differences: dict[str, float]):
    """TAPE at 0.5 on every seed and headline; each baseline `difference` below it, with a spread of 0.01."""
    stat = lambda value: {"mean": value, "std": 0.0, "n": 5, "half_width": 0.0}  # noqa: E731
    spread = (-0.01, 0.01, 0.0, -0.01, 0.01)
    below = {"tape": (0.0,) * 5, **{pe: tuple(e - d for e in spread) for pe, d in differences.items()}}
    rows = {
        pe: {
            "in_distribution": stat(v),
            "per_seed": {
                key: {s: 0.5 + below.get(pe, spread)[s] for s in range(5)}
                for key in ("in_distribution", "longer", "all")
            },
        }
        for pe, v in in_distribution.items()
    }
    return {"task": "addition", "metric": "exact_match", "settings_hash": "h", "rows": rows}


ARITHMETIC = next(claim for claim in CLAIMS if claim.name == "arithmetic")
LEARNED = {"tape": 1.0, "rope": 0.99, "randpe": 0.98, "nope": 0.97, "fire": 0.96}


def test_a_claim_is_confirmed_only_against_every_baseline():
    assert (
        judge(ARITHMETIC, summary_with(LEARNED, dict.fromkeys(("rope", "randpe", "nope", "fire"), 0.05)))[0]
        == "confirmed"
    )
    mixed = {"rope": 0.05, "randpe": 0.05, "nope": 0.05, "fire": 0.0}
    assert judge(ARITHMETIC, summary_with(LEARNED, mixed))[0] == "inconclusive"
    worse = {"rope": 0.05, "randpe": -0.05, "nope": 0.05, "fire": 0.05}
    assert judge(ARITHMETIC, summary_with(LEARNED, worse))[0] == "refuted"


def test_a_claim_needs_models_that_learned_and_results_that_exist():
    unlearned = {**LEARNED, "nope": 0.5}
    result, lines = judge(ARITHMETIC, summary_with(unlearned, dict.fromkeys(("rope", "randpe", "nope", "fire"), 0.05)))
    assert result == "inconclusive" and any("nope: did not learn" in line for line in lines)
    assert judge(ARITHMETIC, summary_with({**LEARNED, "tape": 0.2}, {}))[0] == "inconclusive"
    partly = summary_with({**LEARNED, "tape": 0.9}, {})
    partly["rows"]["tape"]["per_seed"]["in_distribution"] = dict(enumerate((1.0, 0.95, 0.6, 1.0, 0.9)))
    result, lines = judge(ARITHMETIC, partly)
    assert result == "inconclusive" and lines == [
        "tape did not learn addition in distribution (90.0% < 95%; 3 of 5 seeds reach it): nothing to compare"
    ]
    disjoint = summary_with(LEARNED, dict.fromkeys(("rope", "randpe", "nope", "fire"), 0.05))
    disjoint["rows"]["fire"]["per_seed"]["all"] = {7: 0.4}
    result, lines = judge(ARITHMETIC, disjoint)
    assert result == "inconclusive" and "fire: no seed in common with tape" in lines
    assert judge(ARITHMETIC, None)[0] == "not run"
    assert judge(ARITHMETIC, summary_with({"rope": 1.0}, {}))[0] == "not run"


def test_a_claim_about_two_variants_pairs_its_subject_with_its_baseline():
    layers = next(claim for claim in CLAIMS if claim.name == "ablation-layers-addition")
    learned = {"tape-second-half": 1.0, "tape-first-half": 1.0}
    result, lines = judge(layers, summary_with(learned, {"tape-first-half": 0.05}))
    assert result == "confirmed" and lines[0].startswith("tape-second-half − tape-first-half: +5.0")
    assert judge(layers, summary_with(learned, {"tape-first-half": -0.05}))[0] == "refuted"
    assert judge(layers, summary_with({"tape": 1.0, "tape-first-half": 1.0}, {}))[0] == "not run"
