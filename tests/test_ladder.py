"""The compute ladder (issue 63): the rule's end points are the laptop and GPU recipes, sizes grow with t, a rung's
place gives its factor, the trend is a least-squares line in log compute read with its interval, a prediction is
written once and only from rungs that learned, and the report writes it."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tapelm.experiments import ladder
from tapelm.experiments.plan import default_settings_hash
from tapelm.experiments.presets import get_preset
from tapelm.experiments.runs import resolve
from tapelm.report.ladder_section import build
from tapelm.report.sections import ReportContext

SIZES = ("hidden_size", "num_attention_heads", "intermediate_size")


@pytest.mark.parametrize("task", ladder.LADDER_TASKS)
def test_the_first_rung_is_the_archived_laptop_comparison(task):
    spec = ladder.rung_spec(task, 0.0)
    assert spec.model_options == {} and spec.train_options == {}
    assert resolve(spec).settings_hash == default_settings_hash(task)


@pytest.mark.parametrize("task", ladder.LADDER_TASKS)
def test_the_last_rung_has_the_gpu_recipes_sizes(task):
    spec, gpu = ladder.rung_spec(task, 1.0), get_preset(ladder.GPU_PRESET, task)
    assert {k: spec.model_options[k] for k in SIZES} == {k: getattr(gpu.model, k) for k in SIZES}
    assert spec.train_options["steps"] == gpu.train.steps and spec.train_options["batch_size"] == gpu.train.batch_size
    assert spec.train_options["lr"] == gpu.train.lr


@settings(max_examples=20, deadline=None)
@given(low=st.floats(0.001, 1.0), high=st.floats(0.001, 1.0))
def test_sizes_grow_with_the_place_on_the_ladder(low, high):
    low, high = sorted((low, high))
    small, large = ladder.rung_spec("mqar", low), ladder.rung_spec("mqar", high)
    for key in SIZES:
        assert small.model_options[key] <= large.model_options[key]
    for key in ("steps", "batch_size"):
        assert small.train_options[key] <= large.train_options[key]


@pytest.mark.parametrize("task", ladder.LADDER_TASKS)
@settings(max_examples=10, deadline=None)
@given(t=st.floats(0.001, 1.0))
def test_compute_goes_into_tokens_before_the_model(task, t):
    """Tokens first: below the GPU recipe's tokens the model is the laptop's; above them, batch and steps are the
    GPU recipe's."""
    laptop, gpu = get_preset("cpu-small", task), get_preset("gpu", task)
    tokens = (gpu.train.batch_size * gpu.train.steps) / (laptop.train.batch_size * laptop.train.steps)
    top = tokens * (gpu.model.hidden_size / laptop.model.hidden_size) ** 2
    spec = ladder.rung_spec(task, t)
    if top**t <= tokens:
        assert {k: spec.model_options[k] for k in SIZES} == {k: getattr(laptop.model, k) for k in SIZES}
        assert spec.train_options["lr"] == laptop.train.lr
    else:
        assert (spec.train_options["batch_size"], spec.train_options["steps"]) == (
            gpu.train.batch_size,
            gpu.train.steps,
        )


@pytest.mark.parametrize("factor", [1.0, 3.0, 10.0, 100.0])
def test_a_rungs_place_gives_its_factor_of_the_smooth_scaling(factor):
    laptop, gpu = get_preset("cpu-small", "mqar"), get_preset("gpu", "mqar")
    top = (
        (gpu.model.hidden_size / laptop.model.hidden_size) ** 2
        * (gpu.train.batch_size * gpu.train.steps)
        / (laptop.train.batch_size * laptop.train.steps)
    )
    assert top ** ladder.place_of("mqar", factor) == pytest.approx(factor, rel=1e-3)


@pytest.mark.parametrize(
    "task, factor, message",
    [("addition", 3, "has no ladder"), ("mqar", 0.5, "factor=0.5"), ("mqar", 1e6, "GPU recipe's 691x")],
)
def test_bad_rungs_get_one_line_errors(task, factor, message):
    with pytest.raises(ValueError, match=message):
        ladder.rungs(task, [factor])


def test_the_trend_of_differences_on_a_line_is_that_line():
    """Per-seed differences symmetric about a line in log10 compute: the fit is the line, read anywhere."""
    points = [
        (c, {0: 0.1 + 0.05 * math.log10(c) + e, 1: 0.1 + 0.05 * math.log10(c) - e})
        for c, e in [(1e12, 0.02), (3e12, 0.01), (1e13, 0.03)]
    ]
    found = ladder.trend(points, 1e15)
    assert found["slope_per_decade"] == pytest.approx(0.05) and found["mean"] == pytest.approx(0.85)
    assert found["low"] < found["mean"] < found["high"] and found["points"] == 6
    exact = ladder.trend([(c, {0: 0.2 * math.log10(c)}) for c in (1e12, 1e13, 1e14)], 1e16)
    assert exact["mean"] == pytest.approx(3.2) and exact["half_width"] == pytest.approx(0.0, abs=1e-9)
    assert ladder.scored(found, found["mean"]) == "inside" and ladder.scored(found, found["high"] + 0.01) == "outside"
    with pytest.raises(ValueError, match="two computes"):
        ladder.trend([(1e12, {0: 0.1, 1: 0.2, 2: 0.3})], 1e15)


def climbed(learned: bool = True) -> list[dict]:
    return [
        {
            "nominal": n,
            "t": 0.0,
            "factor": n,
            "compute": 1e12 * n,
            "settings_hash": "h",
            "differences": d,
            "learned": {"tape": True, "rope": learned},
        }
        for n, d in (
            (1, {0: 0.10, 1: 0.14, 2: 0.12}),
            (3, {0: 0.12, 1: 0.16, 2: 0.11}),
            (10, {0: 0.15, 1: 0.13, 2: 0.17}),
        )
    ]


def test_the_backtest_predicts_the_highest_rung_from_the_others_and_scores_it():
    """Rungs on one line in log compute: the held-out rung is predicted exactly (inside, error 0); otherwise the
    prediction is the trend of the lower rungs alone, read at the highest rung's compute."""
    on_a_line = [
        {"nominal": n, "compute": 1e12 * n, "differences": {s: 0.1 + 0.05 * math.log10(n) + d for s, d in noise}}
        for n, noise in ((1, ((0, 0.01), (1, -0.01))), (3, ((0, 0.01), (1, -0.01))), (10, ((0, 0.0), (1, 0.0))))
    ]
    tested = ladder.backtest(on_a_line)
    assert tested["held_out"] == 10 and tested["observed"] == pytest.approx(0.15)
    assert tested["prediction"]["mean"] == pytest.approx(0.15) and tested["error"] == pytest.approx(0.0, abs=1e-12)
    assert tested["scored"] == "inside"
    rungs = climbed()
    tested = ladder.backtest(list(reversed(rungs)))  # the order given does not matter: compute decides
    expected = ladder.trend([(r["compute"], r["differences"]) for r in rungs[:2]], rungs[2]["compute"])
    assert tested["prediction"] == expected and tested["observed"] == pytest.approx(0.15)
    assert ladder.backtest(rungs[:2]) is None


def test_a_prediction_is_written_once_from_learned_rungs_and_reported(tmp_path):
    folder = tmp_path / "results" / "ladder"
    with pytest.raises(ValueError, match="did not learn in distribution cannot be compared: 1x rope, 3x rope"):
        ladder.write_prediction("mqar", climbed(learned=False), folder)
    path = ladder.write_prediction("mqar", climbed(), folder)
    record = json.loads(path.read_text())
    assert record["prediction"]["at"] == pytest.approx(ladder.gpu_compute("mqar")) and record["date"]
    with pytest.raises(ValueError, match="holds a prediction already"):
        ladder.write_prediction("mqar", climbed(), folder)
    context = ReportContext(tmp_path, tmp_path / "figures", "figures", tmp_path / "compare")
    text = build(context)
    assert "| 3x | 3e+12 | 3.00 | +13.0 ± " in text and "The GPU rung has not run yet." in text
    tested = ladder.backtest(record["rungs"])
    assert (
        f"Backtest: the line through the rungs below 10x predicts it at {tested['prediction']['mean'] * 100:+.1f}"
        in text
    )
    assert f"(error {tested['error'] * 100:+.1f} points): **{tested['scored']} the interval**." in text
    assert (tmp_path / "figures" / "ladder-mqar.png").stat().st_size > 0
