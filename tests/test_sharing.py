"""`tapelm sharing`: runs trained k at once on one device (here the CPU, pinned as a GPU would be), each k's
throughput from its runs' own training seconds; bad input refused before any run."""

from __future__ import annotations

import json

import pytest

from tapelm.cli import main
from tapelm.experiments.budget import training_flops
from tapelm.experiments.runs import resolve
from tapelm.experiments.sharing import EVAL_N, measure_sharing, sharing_spec, steady_rate
from test_train import tiny_spec


def test_each_count_trains_that_many_runs_at_once_on_the_device(tmp_path) -> None:
    spec = tiny_spec("tape", steps=3)
    lines = []
    record = measure_sharing(spec, [2, 1], "1", tmp_path, log=lines.append)
    assert list(record["at_once"]) == ["1", "2"] and record["device"] == "1"
    flops = training_flops(resolve(spec))
    assert record["flops_per_run"] == flops
    for count, measured in record["at_once"].items():
        results = [
            json.loads((tmp_path / f"{count}-at-once" / f"seed{seed}" / "result.json").read_text())
            for seed in range(int(count))
        ]
        assert [r["identity"]["seed"] for r in results] == list(range(int(count)))
        assert all(r["launch"]["device_slot"] == "1" for r in results)  # every run pinned to the shared device
        rates = [steady_rate(tmp_path / f"{count}-at-once" / f"seed{seed}", flops / 3) for seed in range(int(count))]
        assert measured["run_flops_per_second"] == rates and measured["flops_per_second"] == pytest.approx(sum(rates))
    one, two = record["at_once"]["1"], record["at_once"]["2"]
    assert one["against_one"] == 1.0
    assert two["against_one"] == pytest.approx(two["flops_per_second"] / one["flops_per_second"])
    assert json.loads((tmp_path / "sharing.json").read_text())["at_once"] == record["at_once"]
    assert sum("at once:" in line for line in lines) == 2


def test_the_measured_run_is_the_gpu_recipe_cut_short() -> None:
    spec = sharing_spec("mqar", "rope", 40)
    run, recipe = resolve(spec), resolve(sharing_spec("mqar", "rope", 2400))
    assert spec.preset == "gpu" and spec.eval_n == EVAL_N and run.settings.steps == 40 and run.settings.eval_every == 0
    assert run.config == recipe.config and run.settings.batch_size == recipe.settings.batch_size


@pytest.mark.parametrize(
    "argv, message",
    [
        (["sharing", "mqar", "--runs", "0", "2"], "counts=[0, 2]: give numbers of runs at once, each at least 1"),
        (["sharing", "nosuchtask"], "nosuchtask"),
        (["sharing", "mqar", "--steps", "60"], "steps=60: give at least 100 (two log intervals of 50 steps"),
    ],
)
def test_bad_input_is_one_line_exit_2_before_any_run(tmp_path, capsys, argv, message) -> None:
    assert main([*argv, "--root", str(tmp_path / "sharing")]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1
    assert not (tmp_path / "sharing").exists()
