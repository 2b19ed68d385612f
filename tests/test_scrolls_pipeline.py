"""The SCROLLS pipeline end to end on a tiny tapelm text model: fine-tuning at 4x the pretraining length through
tapelm's training loop (with and without position interpolation), cached batched generation that resumes, scoring
from the command line, and bad arguments refused before any work."""

from __future__ import annotations

import json

import pytest
import torch

from tapelm.cli import main
from tapelm.experiments.runs import RunOptions, RunSpec, run_task
from tapelm.scrolls.data import Example
from tapelm.scrolls.generate import DecodeSettings, predict
from tapelm.scrolls.models import load_source
from tapelm.scrolls.prompting import PromptSettings
from tapelm.scrolls.tasks import get_task

TINY_MODEL = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
CORPUS = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 20


@pytest.fixture(scope="module")
def text_runs(tmp_path_factory):
    """Tiny `tapelm train --task text` runs (TAPE and RoPE), pretrained on 16-byte windows of a small corpus."""
    root = tmp_path_factory.mktemp("scrolls")
    corpus = root / "corpus.py"
    corpus.write_text(CORPUS)
    runs = {}
    for pe in ("tape", "rope"):
        spec = RunSpec(
            task="text",
            pe=pe,
            task_options={"corpus": str(corpus), "train_length": 16, "eval_multipliers": (1, 2)},
            model_options=TINY_MODEL,
            train_options={"steps": 2, "batch_size": 2, "warmup": 0, "log_every": 1},
            eval_n=4,
            eval_batch_size=4,
        )
        run_task(spec, root / f"text-{pe}", RunOptions(progress=False))
        runs[pe] = root / f"text-{pe}"
    data = root / "data"
    data.mkdir()
    rows = {
        "train": [
            {
                "id": f"t{i}",
                "pid": f"t{i}_0",
                "input": f"What is {i}?\n\n{i} is a number. " * 3,
                "output": f"number {i}",
            }
            for i in range(6)
        ],
        "validation": [
            {"id": "v0", "pid": "v0_0", "input": "What is 7?\n\n7 is a number.", "output": "number 7"},
            {"id": "v0", "pid": "v0_1", "input": "What is 7?\n\n7 is a number.", "output": "seven"},
            {"id": "v1", "pid": "v1_0", "input": "What is 8?\n\nEight.", "output": "number 8"},
            {"id": "v2", "pid": "v2_0", "input": "Q?\n\n" + "long " * 30, "output": "long"},
        ],
    }
    for split, split_rows in rows.items():
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split_rows))
    return root, runs, data


def test_finetune_predict_score_end_to_end(text_runs, tmp_path, capsys):
    root, runs, data = text_runs
    out = tmp_path / "qasper-tape"
    assert (
        main(
            [
                "scrolls",
                "finetune",
                "qasper",
                "--model",
                str(runs["tape"]),
                "--data",
                str(data),
                "--out",
                str(out),
                "--target-cap",
                "10",
                "--steps",
                "3",
                "--batch-size",
                "2",
                "--warmup",
                "1",
                "--log-every",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    record = json.loads((out / "scrolls.json").read_text())
    assert record["context"] == 64 and record["pretrained_length"] == 16  # the cpu-small preset: 4x pretraining
    assert record["finished"] and record["training_rows"] == 6
    assert (out / "model" / "config.json").is_file() and (out / "checkpoints").is_dir()
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(loss > 0 for loss in losses)

    assert (
        main(
            [
                "scrolls",
                "predict",
                "qasper",
                "--model",
                str(out),
                "--data",
                str(data),
                "--no-progress",
                "--predict-batch-size",
                "2",
            ]
        )
        == 0
    )
    predictions = json.loads((out / "predictions-validation.json").read_text())
    assert sorted(predictions) == ["v0", "v1", "v2"] and all(isinstance(v, str) for v in predictions.values())
    capsys.readouterr()
    assert (
        main(
            [
                "scrolls",
                "score",
                "qasper",
                "--predictions",
                str(out / "predictions-validation.json"),
                "--data",
                str(data),
                "--out",
                str(tmp_path / "scores.json"),
            ]
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((tmp_path / "scores.json").read_text())
    assert set(printed) == {"f1", "num_predicted", "mean_prediction_length_characters", "scrolls_score"}
    assert printed["num_predicted"] == 3 and 0 <= printed["f1"] <= 100

    # a finished run is not trained again with --resume; without it the folder is refused
    assert (
        main(
            [
                "scrolls",
                "finetune",
                "qasper",
                "--model",
                str(runs["tape"]),
                "--data",
                str(data),
                "--out",
                str(out),
                "--target-cap",
                "10",
                "--steps",
                "3",
                "--batch-size",
                "2",
                "--warmup",
                "1",
                "--log-every",
                "1",
                "--no-progress",
                "--resume",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "scrolls",
                "finetune",
                "qasper",
                "--model",
                str(runs["tape"]),
                "--data",
                str(data),
                "--out",
                str(out),
                "--target-cap",
                "10",
                "--steps",
                "3",
                "--batch-size",
                "2",
                "--warmup",
                "1",
                "--log-every",
                "1",
                "--no-progress",
            ]
        )
        == 2
    )


def test_run_is_finetune_then_predict_then_score(text_runs, tmp_path):
    _, runs, data = text_runs
    out = tmp_path / "runs"
    assert (
        main(
            [
                "scrolls",
                "run",
                "narrative_qa",
                "--model",
                str(runs["rope"]),
                "--data",
                str(data),
                "--out",
                str(out),
                "--target-cap",
                "6",
                "--steps",
                "2",
                "--batch-size",
                "2",
                "--warmup",
                "0",
                "--position-interpolation",
                "--predict-batch-size",
                "3",
                "--no-progress",
            ]
        )
        == 0
    )
    record = json.loads((out / "narrative_qa" / "scrolls.json").read_text())
    assert record["identity"]["position_interpolation"] and record["context"] == 64
    config = json.loads((out / "narrative_qa" / "model" / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "linear" and config["rope_parameters"]["factor"] == 4.0
    scores = json.loads((out / "narrative_qa" / "scores-validation.json").read_text())
    assert scores["num_predicted"] == 3 and "f1" in scores
    predictions = json.loads((out / "narrative_qa" / "predictions-validation.json").read_text())
    assert sorted(predictions) == ["v0", "v1", "v2"]


def test_position_interpolation_for_the_rope_family_only(text_runs):
    _, runs, _ = text_runs
    source = load_source(runs["rope"], context=64, position_interpolation=True)
    assert source.model.config.rope_parameters["rope_type"] == "linear"
    assert source.model.config.rope_parameters["factor"] == pytest.approx(4.0)
    plain = load_source(runs["rope"], context=64)
    ids = torch.tensor([list(b"def add(a, b):\n    return a + b\n")])
    with torch.no_grad():
        # position 0 and 1 at factor 4 differ from the original model's: the angles really shrank
        assert not torch.allclose(source.model(ids).logits, plain.model(ids).logits)
    tape = load_source(runs["tape"], context=64, position_interpolation=True)  # TAPE's initial state is RoPE's
    with torch.no_grad():
        assert not torch.allclose(tape.model(ids).logits, load_source(runs["tape"], context=64).model(ids).logits)
    with pytest.raises(ValueError, match="needs context=16 > the pretraining length 16"):
        load_source(runs["tape"], context=16, position_interpolation=True)


def test_predictions_resume_and_batches_equal_single_examples(text_runs, tmp_path):
    _, runs, _ = text_runs
    source = load_source(runs["tape"], context=64)
    task = get_task("narrative_qa")
    prompts = PromptSettings(64, 8)
    examples = [Example(f"e{i}", f"Question {i}?\n\n" + "text " * i, ["x"]) for i in range(5)]
    out = tmp_path / "predictions.json"
    out.write_text(json.dumps({"e1": "SENTINEL"}))
    batched = predict(
        source.model, source.codec, task, examples, out, prompts, DecodeSettings(batch_size=4), progress=False
    )
    assert batched["e1"] == "SENTINEL"  # already predicted: skipped, kept
    assert json.loads(out.read_text()) == batched and sorted(batched) == [f"e{i}" for i in range(5)]
    alone = predict(
        source.model,
        source.codec,
        task,
        examples,
        tmp_path / "alone.json",
        prompts,
        DecodeSettings(batch_size=1),
        progress=False,
    )
    assert {k: v for k, v in alone.items() if k != "e1"} == {k: v for k, v in batched.items() if k != "e1"}
    before = out.read_text()
    predict(source.model, source.codec, task, examples, out, prompts, DecodeSettings(batch_size=4), progress=False)
    assert out.read_text() == before  # nothing left to do


@pytest.mark.parametrize(
    "argv, message",
    [
        (["scrolls", "score", "squad", "--predictions", "p.json"], "task='squad' is not allowed"),
        (["scrolls", "predict", "qasper", "--model", "MODEL", "--split", "dev"], "split='dev' is not allowed"),
        (
            ["scrolls", "finetune", "qasper", "--model", "MODEL", "--out", "OUT", "--preset", "gpu"],
            "preset='gpu' is not allowed; choose one of: paper, cpu-small",
        ),
        (
            ["scrolls", "finetune", "qasper", "--model", "MODEL", "--out", "OUT", "--schedule", "linear"],
            "schedule='linear' is not allowed",
        ),
        (
            ["scrolls", "finetune", "qasper", "--model", "missing-model", "--out", "OUT"],
            "--model 'missing-model' does not exist",
        ),
        (["scrolls", "run", "all", "--model", "MODEL", "--out", "OUT", "--context", "0"], "context=0 is not allowed"),
        (
            ["scrolls", "run", "all", "--model", "MODEL", "--out", "OUT"],
            "qasper' does not exist",
        ),  # no per-task folders
        (
            ["scrolls", "run", "qasper", "--model", "MODEL", "--out", "OUT", "--data", "TRAIN_FILE"],
            "is one file for both splits: `scrolls run` would fine-tune on the rows it then scores",
        ),
        (
            ["scrolls", "run", "qasper", "--model", "MODEL", "--out", "OUT", "--split", "train"],
            "--split train is not allowed for `scrolls run`",
        ),
        (
            ["scrolls", "run", "qasper", "--model", "MODEL", "--out", "OUT", "--target-cap", "10", "--top-k", "0"],
            "top_k=0 is not allowed",
        ),  # decoding options are checked before fine-tuning
        (
            [
                "scrolls",
                "run",
                "qasper",
                "--model",
                "MODEL",
                "--out",
                "OUT",
                "--target-cap",
                "10",
                "--predict-limit",
                "0",
            ],
            "--predict-limit=0 is not allowed",
        ),
        (
            ["scrolls", "finetune", "qasper", "--model", "MODEL", "--out", "FILE"],
            "--out 'FILE' is a file; give a folder",
        ),
        (
            ["scrolls", "finetune", "qasper", "--model", "MODEL", "--out", "OUT", "--target-cap", "10", "--pe", "rope"],
            "--pe rope does not apply to",
        ),  # a tapelm text run keeps its own encoding
        (
            ["scrolls", "finetune", "qasper", "--model", "MODEL", "--out", "OUT", "--target-cap", "52"],
            "leaves 11 prompt tokens after target_cap=52 + eos, and the question alone fills them",
        ),
        (
            ["scrolls", "predict", "qasper", "--model", "MODEL", "--out", "FOLDER", "--context", "64"],
            "is a folder; give the predictions file to write",
        ),
    ],
)
def test_bad_arguments_fail_in_one_line_before_any_work(text_runs, tmp_path, capsys, argv, message):
    _, runs, data = text_runs
    (tmp_path / "FILE").write_text("")
    (tmp_path / "FOLDER").mkdir()
    names = {
        "MODEL": str(runs["tape"]),
        "OUT": str(tmp_path / "out"),
        "FILE": str(tmp_path / "FILE"),
        "FOLDER": str(tmp_path / "FOLDER"),
        "TRAIN_FILE": str(data / "train.jsonl"),
    }
    argv = [names.get(a, a) for a in argv]
    message = message.replace("FILE", names["FILE"])
    if "--data" not in argv:
        argv += ["--data", str(data)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert not (tmp_path / "out").exists()


def test_a_llama_family_checkpoint_with_its_own_tokenizer(text_runs, tmp_path):
    """A Llama checkpoint folder is converted (to TAPE by default), fine-tuned with its tokenizer's EOS ending the
    targets and linear position interpolation, saved with the tokenizer, and predicts from the run folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    _, _, data = text_runs
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    backend.train_from_iterator([(data / "train.jsonl").read_text()] * 2, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    torch.manual_seed(0)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=backend.get_vocab_size(),
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            bos_token_id=1,
            eos_token_id=2,
        )
    )
    llama.save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    out = tmp_path / "run"
    assert (
        main(
            [
                "scrolls",
                "finetune",
                "qasper",
                "--model",
                str(tmp_path / "llama"),
                "--data",
                str(data),
                "--out",
                str(out),
                "--context",
                "64",
                "--target-cap",
                "6",
                "--steps",
                "2",
                "--batch-size",
                "2",
                "--warmup",
                "0",
                "--position-interpolation",
                "--pretrained-length",
                "16",
                "--no-progress",
            ]
        )
        == 0
    )
    record = json.loads((out / "scrolls.json").read_text())
    assert record["tokenizer"] == {"kind": "hf"} and record["identity"]["pe"] == "tape"
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["rope_parameters"]["factor"] == 4.0 and (out / "model" / "tokenizer.json").is_file()
    source = load_source(out)
    assert source.codec.eos_id == 2 and source.codec.pad_id == 2  # no pad token: EOS pads
    assert source.codec.decode(source.codec.encode("What is 1?")) == "What is 1 ?"  # the checkpoint's own BPE
    assert main(["scrolls", "predict", "qasper", "--model", str(out), "--data", str(data), "--no-progress"]) == 0
    assert sorted(json.loads((out / "predictions-validation.json").read_text())) == ["v0", "v1", "v2"]


def test_the_cpu_small_target_cap_leaves_the_document_most_of_the_context(text_runs, tmp_path):
    _, runs, data = text_runs
    out = tmp_path / "run"
    assert (
        main(
            [
                "scrolls",
                "finetune",
                "qasper",
                "--model",
                str(runs["tape"]),
                "--data",
                str(data),
                "--out",
                str(out),
                "--steps",
                "1",
                "--batch-size",
                "2",
                "--warmup",
                "0",
                "--no-progress",
            ]
        )
        == 0
    )
    record = json.loads((out / "scrolls.json").read_text())
    assert record["target_cap"] == 16 and record["identity"]["target_cap"] == 16  # 64 // 4, not QA's 200


def test_a_finetuned_run_moves_without_its_source(text_runs, tmp_path):
    """The run records no path to reread: its text run's tokenizer is rebuilt from the task options."""
    import shutil

    root, runs, data = text_runs
    source = tmp_path / "text-run"
    shutil.copytree(runs["tape"], source)
    out = tmp_path / "run"
    assert (
        main(
            [
                "scrolls",
                "finetune",
                "qasper",
                "--model",
                str(source),
                "--data",
                str(data),
                "--out",
                str(out),
                "--target-cap",
                "10",
                "--steps",
                "1",
                "--batch-size",
                "2",
                "--warmup",
                "0",
                "--no-progress",
            ]
        )
        == 0
    )
    assert str(tmp_path) not in json.dumps(json.loads((out / "scrolls.json").read_text())["tokenizer"])
    shutil.rmtree(source)
    moved = tmp_path / "elsewhere" / "run"
    shutil.move(out, moved)
    assert main(["scrolls", "predict", "qasper", "--model", str(moved), "--data", str(data), "--no-progress"]) == 0
    assert sorted(json.loads((moved / "predictions-validation.json").read_text())) == ["v0", "v1", "v2"]


def test_unreadable_inputs_are_one_line_errors(text_runs, tmp_path, capsys):
    import shutil

    _, runs, data = text_runs
    bad = tmp_path / "bad-data"
    shutil.copytree(data, bad)
    lines = (bad / "train.jsonl").read_text().splitlines()
    (bad / "train.jsonl").write_text("\n".join([lines[0], lines[1][:-3], *lines[2:]]) + "\n")
    assert (
        main(
            [
                "scrolls",
                "finetune",
                "qasper",
                "--model",
                str(runs["tape"]),
                "--data",
                str(bad),
                "--out",
                str(tmp_path / "out"),
                "--target-cap",
                "10",
                "--no-progress",
            ]
        )
        == 2
    )
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "train.jsonl' line 2 is not valid JSON" in error
    assert not (tmp_path / "out").exists()

    out = tmp_path / "run"
    assert (
        main(
            [
                "scrolls",
                "finetune",
                "qasper",
                "--model",
                str(runs["tape"]),
                "--data",
                str(data),
                "--out",
                str(out),
                "--target-cap",
                "10",
                "--steps",
                "1",
                "--batch-size",
                "2",
                "--warmup",
                "0",
                "--no-progress",
            ]
        )
        == 0
    )
    weights = out / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short
    capsys.readouterr()
    assert main(["scrolls", "predict", "qasper", "--model", str(out), "--data", str(data), "--no-progress"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "cannot be read" in error and "truncated or corrupt" in error


def test_predicting_on_the_training_rows_warns(text_runs, tmp_path, capsys):
    _, runs, data = text_runs
    out = tmp_path / "run"
    assert (
        main(
            [
                "scrolls",
                "finetune",
                "qasper",
                "--model",
                str(runs["tape"]),
                "--data",
                str(data),
                "--out",
                str(out),
                "--target-cap",
                "10",
                "--steps",
                "1",
                "--batch-size",
                "2",
                "--warmup",
                "0",
                "--no-progress",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert (
        main(
            [
                "scrolls",
                "predict",
                "qasper",
                "--model",
                str(out),
                "--data",
                str(data),
                "--split",
                "train",
                "--no-progress",
                "--predict-limit",
                "2",
            ]
        )
        == 0
    )
    assert "predicting 'qasper' on the rows this model was fine-tuned on" in capsys.readouterr().err
