"""Saved folders that clients load without importing tapelm, and the tokenizer every run saves and reuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from tapelm.experiments.runs import RunOptions, RunSpec, load_run, run_task
from tapelm.experiments.tasks import ByteTokenizer, SymbolTokenizer, get_task, load_tokenizer
from tapelm.experiments.tasks import text as text_task
from tapelm.training.checkpoints import CheckpointError

SRC = Path(__file__).resolve().parents[1] / "src"
TINY_MODEL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}
TINY_TRAIN = {"steps": 3, "batch_size": 4, "warmup": 1, "log_every": 1}


def tiny_run(tmp_path: Path, task: str, name: str = "run", **task_options) -> Path:
    spec = RunSpec(
        task=task,
        pe="tape",
        task_options=task_options,
        model_options=TINY_MODEL,
        train_options=TINY_TRAIN,
        eval_n=4,
        eval_batch_size=4,
    )
    run_task(spec, tmp_path / name, RunOptions(progress=False))
    return tmp_path / name


def client(script: str, cwd: Path) -> str:
    """Run `script` in a fresh interpreter that can import tapelm but has not: the way a client loads a folder."""
    prelude = "import sys\nassert 'tapelm' not in sys.modules\n"
    environment = {
        **os.environ,
        "PYTHONPATH": str(SRC),
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(cwd / "hf"),
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script)],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_run_folder_loads_with_the_auto_classes_without_importing_tapelm(tmp_path: Path) -> None:
    run_dir = tiny_run(tmp_path, "copy", max_length=6)
    run = load_run(run_dir)
    model = run.load_model().eval()
    batch = next(run.task.eval_batches(run.task.eval_conditions()[0], 0, 3, 3))
    with torch.no_grad():
        expected = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    torch.save({"batch": batch.input_ids, "mask": batch.attention_mask, "logits": expected}, tmp_path / "ref.pt")
    text = run.task.tokenizer.decode(batch.input_ids[0].tolist())  # a copy example: symbols of the vocabulary
    out = client(
        f"""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        folder = "{run_dir / "model"}"
        config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        ref = torch.load("{tmp_path / "ref.pt"}")
        with torch.no_grad():
            logits = model(input_ids=ref["batch"], attention_mask=ref["mask"]).logits
        assert torch.equal(logits, ref["logits"]), (logits - ref["logits"]).abs().max()
        for where in (folder, "{run_dir}"):
            tokenizer = AutoTokenizer.from_pretrained(where)
            ids = tokenizer({text!r}, add_special_tokens=False)["input_ids"]
            assert ids == {run.task.tokenizer.encode(text)!r}, ids
        model.save_pretrained("again")  # a client's own save keeps the modules, not a copy of tapelm's code
        print(type(config).__module__, type(model).__module__, sorted(__import__("os").listdir("again")))
    """,
        tmp_path,
    )
    assert out.startswith("tapelm.config tapelm.modeling")
    assert "configuration_tape.py" in out and "config.py" not in out.replace("configuration_tape.py", "")
    assert (
        json.loads((tmp_path / "again" / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"]
        == "modeling_tape.TapeForCausalLM"
    )


@given(st.text(alphabet="k12v<bos>eo#( ", max_size=30))
def test_symbol_tokenizer_and_its_transformers_twin_agree(text: str) -> None:
    tokenizer = SymbolTokenizer(["k1", "k12", "v2", "2", "print ", "#", "("])
    twin = tokenizer.to_transformers()
    try:
        expected = tokenizer.encode(text)
    except ValueError:
        with pytest.raises(Exception, match="WordLevel"):
            twin(text, add_special_tokens=False)
        return
    assert twin(text, add_special_tokens=False)["input_ids"] == expected
    assert twin.decode(expected) == tokenizer.decode(expected)
    assert (twin.pad_token_id, twin.bos_token_id, twin.eos_token_id) == (0, 1, 2)


@given(st.text(max_size=40))
@example("a<pad>b")  # text that spells the special token is bytes to both (hypothesis found it)
def test_byte_tokenizer_and_its_transformers_twin_agree(text: str) -> None:
    tokenizer = ByteTokenizer()
    twin = tokenizer.to_transformers()
    ids = tokenizer.encode(text)
    assert twin(text, add_special_tokens=False)["input_ids"] == ids
    assert twin.pad_token_id == tokenizer.pad_id and len(twin) == tokenizer.vocab_size
    assert twin.decode([*ids, tokenizer.pad_id], skip_special_tokens=True) == text


def _write_corpus(root: Path, word: str) -> str:
    root.mkdir(exist_ok=True)
    for i in range(21):
        (root / f"f{i:02d}.txt").write_text(" ".join(f"{word}{(i * 7 + j) % 11}" for j in range(80)) + "\n")
    return str(root)


def test_a_text_run_saves_its_bpe_and_every_later_use_reuses_it(tmp_path: Path) -> None:
    corpus = _write_corpus(tmp_path / "corpus", "alpha")
    options = {
        "corpus": corpus,
        "train_length": 16,
        "tokenizer": "bpe",
        "bpe_vocab_size": 300,
        "eval_multipliers": (1, 2),
    }
    run_dir = tiny_run(tmp_path, "text", **options)
    trained = get_task("text", **options).tokenizer  # the one training used (cached in this process)
    saved = load_tokenizer(run_dir / "model")
    sample = "alpha3 alpha10 beta7\n"
    assert saved.encode(sample) == trained.encode(sample) and saved.vocab_size == trained.vocab_size
    assert saved.decode(saved.encode(sample)) == sample
    result = json.loads((run_dir / "result.json").read_text())

    _write_corpus(tmp_path / "corpus", "beta")  # the corpus changes (another machine, another Python) ...
    text_task._load.cache_clear()
    retrained = get_task("text", **options).tokenizer
    assert retrained.encode(sample) != trained.encode(sample)  # ... so a retrained BPE would give other ids
    run = load_run(run_dir)
    assert run.task.tokenizer.encode(sample) == trained.encode(sample)
    from tapelm.experiments.commands import evaluate_run

    evaluation = evaluate_run(run_dir, progress=False)
    assert evaluation["n"] == run.preset.eval_n
    assert json.loads((run_dir / "result.json").read_text())["metric"] == result["metric"]


def test_a_text_run_without_a_saved_bpe_is_refused(tmp_path: Path) -> None:
    corpus = _write_corpus(tmp_path / "corpus", "gamma")
    options = {
        "corpus": corpus,
        "train_length": 16,
        "tokenizer": "bpe",
        "bpe_vocab_size": 280,
        "eval_multipliers": (1, 2),
    }
    spec = RunSpec(
        task="text",
        pe="rope",
        task_options=options,
        model_options=TINY_MODEL,
        train_options={**TINY_TRAIN, "checkpoint_every": 1},
        eval_n=4,
        eval_batch_size=4,
    )
    run_dir = tmp_path / "old"
    assert run_task(spec, run_dir, RunOptions(progress=False), stop_after=1) is None
    (run_dir / "tokenizer.json").unlink()  # as a run written before runs saved their tokenizer
    with pytest.raises(ValueError, match="has no saved tokenizer"):
        load_run(run_dir)
    with pytest.raises(CheckpointError, match="started before runs saved their tokenizer"):
        run_task(spec, run_dir, RunOptions(progress=False), resume=True)
