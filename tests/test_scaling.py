"""RoPE's inference-time scalings as rows of a comparison: each equals transformers' own rotary embedding under that
scaling (NTK-aware by its formula), dynamic NTK leaves the model unchanged up to the training length, the rows are
evaluated from the trained row's models without training, and a row that cannot apply is refused before any work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from conftest import TINY_ADDITION as TINY
from tapelm.cli import main
from tapelm.config import TapeConfig
from tapelm.experiments.runs import RESULT_FILE, load_run
from tapelm.experiments.scaling import scaled_config, scaling
from tapelm.modeling import TapeForCausalLM
from tapelm.training.saved_models import load_saved_model

ROWS = ["rope-ntk", "rope-dynamic", "rope-yarn", "tape-yarn"]


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    assert main(["compare", "addition", "--pe", *ROWS, "--seeds", "0", "1", "--root", str(root), *TINY]) == 0
    (directory,) = list((root / "compare" / "addition").iterdir())
    return directory


def _inverse_frequencies(model: TapeForCausalLM, length: int) -> torch.Tensor:
    rotary = model.model.positional.rotary
    rotary(torch.empty(0), torch.arange(length)[None])  # a dynamic scaling settles on the length it sees
    return rotary.inv_freq.double()


def test_each_scaling_is_transformers_own_rotary_embedding_under_it(compared) -> None:
    run_dir = compared / "rope" / "seed0"
    run, config = load_run(run_dir), TapeConfig.from_pretrained(str(run_dir / "model"))
    longest = run.task.max_eval_length
    for method in ("dynamic", "yarn"):
        scaled = scaled_config(config, scaling(run, method))
        model = load_saved_model(run_dir / "model", TapeForCausalLM, config=scaled)
        fields = {"hidden_size": config.hidden_size, "num_attention_heads": config.num_attention_heads}
        llama = LlamaConfig(
            **fields, max_position_embeddings=scaled.max_position_embeddings, rope_parameters=scaled.rope_parameters
        )
        reference = LlamaRotaryEmbedding(llama)
        reference(torch.empty(0), torch.arange(longest)[None])
        assert torch.allclose(_inverse_frequencies(model, longest), reference.inv_freq.double(), rtol=1e-6)
        assert model.model.positional.rotary.attention_scaling == pytest.approx(reference.attention_scaling)
    applied = scaling(run, "ntk")
    assert applied["factor"] == pytest.approx(longest / run.task.train_length) and applied["factor"] > 1
    ntk = load_saved_model(run_dir / "model", TapeForCausalLM, config=scaled_config(config, applied))
    trained = load_saved_model(run_dir / "model", TapeForCausalLM)
    ratio = _inverse_frequencies(ntk, longest) / _inverse_frequencies(trained, longest)
    assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(1 / applied["factor"])  # lowest by s


def test_dynamic_ntk_changes_nothing_up_to_the_training_length_and_acts_beyond(compared) -> None:
    run_dir = compared / "rope" / "seed0"
    run = load_run(run_dir)
    config = TapeConfig.from_pretrained(str(run_dir / "model"))
    trained = load_saved_model(run_dir / "model", TapeForCausalLM).double()
    dynamic = load_saved_model(
        run_dir / "model", TapeForCausalLM, config=scaled_config(config, scaling(run, "dynamic"))
    ).double()
    ids = torch.randint(0, config.vocab_size, (2, run.task.max_eval_length), generator=torch.Generator().manual_seed(0))
    short = ids[:, : run.task.train_length]
    with torch.no_grad():
        assert torch.equal(trained(short).logits, dynamic(short).logits)
        assert not torch.allclose(trained(ids).logits, dynamic(ids).logits, atol=1e-9)


def test_the_rows_are_evaluated_from_the_trained_rows_models_without_training(compared) -> None:
    record = json.loads((compared / "comparison.json").read_text())
    assert record["runs"] == {
        row: [0, 1] for row in ("rope", "rope-ntk", "rope-dynamic", "rope-yarn", "tape", "tape-yarn")
    }
    for row in ROWS:
        trained_as = row.split("-")[0]
        for seed in (0, 1):
            result = json.loads((compared / row / f"seed{seed}" / RESULT_FILE).read_text())
            trained = json.loads((compared / trained_as / f"seed{seed}" / RESULT_FILE).read_text())
            assert result["identity"] == trained["identity"]  # the same model: paired by seed with it
            assert result["evaluated_with"]["method"] == row.split("-")[1] and result["pe"] == row
            assert result["train_seconds_this_session"] == 0
            assert not (compared / row / f"seed{seed}" / "model").exists()
            assert (compared / row / f"seed{seed}" / "metrics.jsonl").read_bytes() == (
                compared / trained_as / f"seed{seed}" / "metrics.jsonl"
            ).read_bytes()


def test_a_row_is_refused_before_any_work_when_its_scaling_has_nothing_to_extend_to(tmp_path, capsys) -> None:
    argv = ["compare", "addition", "--pe", "rope-yarn", "--seeds", "0", "--root", str(tmp_path), *TINY]
    argv[argv.index("eval_max_digits=3")] = "eval_max_digits=2"
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "evaluates no longer than it trains" in error
    assert not (tmp_path / "compare").exists()


def test_a_row_whose_trained_model_is_gone_says_how_to_get_it_back(compared, tmp_path, capsys) -> None:
    """A run restored from the archive keeps its results but no model: the row evaluated from it cannot be made, and
    says so in one line instead of evaluating anything else."""
    root = tmp_path / "runs"
    copy = root / "compare" / "addition" / compared.name
    shutil.copytree(compared, copy)
    shutil.rmtree(copy / "rope" / "seed1" / "model")
    shutil.rmtree(copy / "rope-yarn" / "seed1")
    argv = ["compare", "addition", "--pe", "rope-yarn", "--seeds", "0", "1", "--root", str(root), *TINY]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "which is not there (the archive keeps no models)" in error
    assert not (copy / "rope-yarn" / "seed1").exists()
