"""Training keyed apart from evaluation: a comparison that differs from another only in its evaluation takes the
other's trained models instead of training again, and the law behind it holds (a run trained again from scratch
under the same training identity is the same model); an encoding that reads the position limits (RandPE) trains
again; a row evaluated from a model that was trained again since is evaluated again."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY_ADDITION as TINY
from tapelm.cli import main
from tapelm.experiments.runs import RESULT_FILE, training_fingerprint, training_identity

LONGER = [("eval_max_digits=4" if flag == "eval_max_digits=3" else flag) for flag in TINY]
assert LONGER != TINY


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "model" / "model.safetensors")


def _result(run_dir: Path) -> dict:
    return json.loads((run_dir / RESULT_FILE).read_text())


def _comparisons(root: Path) -> dict[int, Path]:
    """{longest evaluated digits: comparison folder} under `root`."""
    found = {}
    for folder in (root / "compare" / "addition").iterdir():
        found[json.loads((folder / "comparison.json").read_text())["task_options"]["eval_max_digits"]] = folder
    return found


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Two comparisons of addition that differ only in the longest evaluated sum: 3 digits, then 4."""
    root = tmp_path_factory.mktemp("runs")
    assert main(["compare", "addition", "--pe", "rope", "randpe", "--seeds", "0", "--root", str(root), *TINY]) == 0
    pes = ["rope", "randpe", "rope-ntk"]
    assert main(["compare", "addition", "--pe", *pes, "--seeds", "0", "--root", str(root), *LONGER]) == 0
    return root


def test_a_comparison_differing_only_in_evaluation_takes_the_trained_model(root) -> None:
    shorter, longer = _comparisons(root)[3], _comparisons(root)[4]
    taken, trained = longer / "rope" / "seed0", shorter / "rope" / "seed0"
    result = _result(taken)
    assert result["trained_in"] == shorter.name and result["train_seconds_this_session"] == 0.0
    assert result["train_seconds_before_this_session"] == _result(trained)["train_seconds_this_session"] > 0
    assert result["final_loss"] == _result(trained)["final_loss"] and result["settings_hash"] == longer.name
    assert not (taken / "checkpoints").exists()
    weights, original = _weights(taken), _weights(trained)
    assert weights.keys() == original.keys() and all(torch.equal(weights[k], original[k]) for k in weights)
    configs = [json.loads((run / "model" / "config.json").read_text()) for run in (taken, trained)]
    assert configs[0]["max_position_embeddings"] > configs[1]["max_position_embeddings"]  # saved under its own
    shared = _result(trained)["summary"]["by_length"]
    assert {n: _result(taken)["summary"]["by_length"][n] for n in shared} == shared  # same model, same test sets
    assert len(_result(taken)["summary"]["by_length"]) > len(shared)


def test_an_encoding_that_reads_the_position_limit_trains_again(root) -> None:
    shorter, longer = _comparisons(root)[3], _comparisons(root)[4]
    again = _result(longer / "randpe" / "seed0")
    assert "trained_in" not in again and again["train_seconds_this_session"] > 0
    identities = [training_identity(_result(c / "randpe" / "seed0")["identity"]) for c in (shorter, longer)]
    assert identities[0] != identities[1] and identities[0]["model"]["randpe_max_position"] is not None


def test_the_same_training_identity_trains_the_same_model(root, tmp_path) -> None:
    """The law that makes taking a model sound: RoPE trained from scratch at the longer evaluation is, bit for bit,
    the model trained for the shorter one."""
    assert main(["compare", "addition", "--pe", "rope", "--seeds", "0", "--root", str(tmp_path), *LONGER]) == 0
    (fresh,) = (tmp_path / "compare" / "addition").iterdir()
    assert "trained_in" not in _result(fresh / "rope" / "seed0")
    weights, original = _weights(fresh / "rope" / "seed0"), _weights(_comparisons(root)[3] / "rope" / "seed0")
    assert all(torch.equal(weights[k], original[k]) for k in original)
    identities = [_result(c / "rope" / "seed0")["identity"] for c in (fresh, _comparisons(root)[3])]
    assert identities[0] != identities[1] and training_identity(identities[0]) == training_identity(identities[1])


def test_a_row_evaluated_from_a_model_trained_again_is_evaluated_again(root, tmp_path, capsys) -> None:
    copy = tmp_path / "runs"
    shutil.copytree(root, copy)
    longer = _comparisons(copy)[4]
    row, trained = longer / "rope-ntk" / "seed0", longer / "rope" / "seed0"
    assert _result(row)["trained_fingerprint"] == training_fingerprint(_result(trained))
    retrained = {**_result(trained), "final_loss": 0.5}  # what a model trained again records
    (trained / RESULT_FILE).write_text(json.dumps(retrained))
    capsys.readouterr()
    assert main(["compare", "addition", "--pe", "rope-ntk", "--seeds", "0", "--root", str(copy), *LONGER]) == 0
    assert "rope-ntk / seed 0: stale: rope's model was trained again" in capsys.readouterr().out
    assert _result(row)["trained_fingerprint"] == training_fingerprint(retrained)
    assert main(["compare", "addition", "--pe", "rope-ntk", "--seeds", "0", "--root", str(copy), *LONGER]) == 0
    assert "rope-ntk / seed 0: cached" in capsys.readouterr().out
