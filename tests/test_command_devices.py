"""Every command runs its model on the device of its process and moves its inputs there.

CI has no GPU, so the process's device is made `meta` (accelerate's ACCELERATE_TORCH_DEVICE): a command that keeps its
model on the CPU, or hands it CPU tensors, is caught at its first model call (`InputWatch`), which then stops it (a
model on the meta device computes nothing)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from device_checks import InputWatch, ModelReached
from tapelm.cli import main
from test_finetune import finetune_cli, finetune_inputs  # noqa: F401  (a tiny Llama folder and prose corpus)
from test_scrolls_pipeline import text_runs  # noqa: F401  (tiny text runs and a SCROLLS-format task)
from test_train import tiny_cli

META = torch.device("meta")


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def watch(monkeypatch):
    """The process's device is `meta`; the first model call is checked, then the command stops."""
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "meta")
    reset_accelerate()
    yield InputWatch().install(monkeypatch)
    monkeypatch.delenv("ACCELERATE_TORCH_DEVICE")
    reset_accelerate()


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device-run") / "run"
    assert main(tiny_cli(out)) == 0
    return out


@pytest.fixture(scope="module")
def llama_on_meta(finetune_inputs):  # noqa: F811
    from tapelm.pretrained.sources import load_pretrained

    source, tokenizer = load_pretrained(finetune_inputs["llama"])
    return source.to(META).eval(), tokenizer


def reached(watch: InputWatch, run) -> None:
    with pytest.raises(ModelReached):
        run()
    watch.assert_on(META)


def test_train(watch, tmp_path):
    reached(watch, lambda: main(tiny_cli(tmp_path / "run")))


def test_eval(watch, trained_run):
    reached(watch, lambda: main(["eval", str(trained_run), "--n", "2", "--no-progress"]))


def test_evaluation_during_training(watch, trained_run):
    from tapelm.experiments.runs import _quick_evaluation, load_run

    run = load_run(trained_run)
    reached(watch, lambda: _quick_evaluation(run)(run.load_model().to(META), 1))


def test_finetune_trains_on_the_process_device(watch, finetune_inputs, tmp_path):  # noqa: F811
    reached(watch, lambda: main(finetune_cli(finetune_inputs, tmp_path / "out")))


def test_finetune_evaluates_the_original_on_the_process_device(watch, finetune_inputs, tmp_path):  # noqa: F811
    argv = ["all" if a == "lora" else a for a in finetune_cli(finetune_inputs, tmp_path / "out") if a != "--no-eval"]
    reached(watch, lambda: main([*argv, "--eval-lengths", "16", "--passkey-lengths", "--eval-documents", "1"]))


def test_convert_check_compares_logits_on_the_process_device(watch, llama_on_meta):
    from tapelm.conversion import from_pretrained_llama
    from tapelm.pretrained.retrofit import _logit_diff

    source, tokenizer = llama_on_meta
    converted = from_pretrained_llama(source, pe_type="tape")
    assert converted.device == META
    documents = {"prose": [np.arange(40) % source.config.vocab_size]}
    reached(watch, lambda: _logit_diff(source, converted, documents, tokenizer))


@pytest.mark.parametrize("part", ["perplexity", "passkey", "generation"])
def test_pretrained_evaluations(watch, llama_on_meta, part):
    from tapelm.pretrained import evaluation

    model, tokenizer = llama_on_meta
    documents = [np.arange(200) % model.config.vocab_size]
    run = {
        "perplexity": lambda: evaluation.perplexity(model, documents, 32, 64, 16),
        "passkey": lambda: evaluation.passkey(model, tokenizer, 512, trials=1),
        "generation": lambda: evaluation.generation_sample(model, tokenizer, "The grass is"),
    }[part]
    reached(watch, run)


def test_extend_evaluates_a_zero_training_row_on_the_process_device(watch, finetune_inputs, tmp_path):  # noqa: F811
    from tapelm.pretrained.extend import run_one
    from test_extend import tiny_plan

    reached(watch, lambda: run_one(tiny_plan(finetune_inputs, tmp_path / "out"), "base", 0))


def test_scrolls_finetune(watch, text_runs, tmp_path):  # noqa: F811
    root, runs, data = text_runs
    reached(
        watch,
        lambda: main(
            [
                "scrolls",
                "finetune",
                "qasper",
                "--model",
                str(runs["tape"]),
                "--data",
                str(data),
                "--out",
                str(tmp_path / "out"),
                "--steps",
                "1",
                "--batch-size",
                "2",
                "--no-progress",
            ]
        ),
    )


def test_scrolls_predict(watch, text_runs, tmp_path):  # noqa: F811
    root, runs, data = text_runs
    reached(
        watch,
        lambda: main(
            [
                "scrolls",
                "predict",
                "qasper",
                "--model",
                str(runs["tape"]),
                "--data",
                str(data),
                "--split",
                "validation",
                "--context",
                "64",
                "--target-cap",
                "10",
                "--out",
                str(tmp_path / "p.json"),
                "--no-progress",
            ]
        ),
    )
