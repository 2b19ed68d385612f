"""lm-evaluation-harness as a client: the plain `lm_eval` command on a saved tapelm folder, with a local task."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tapelm import TapeConfig, TapeForCausalLM
from tapelm.experiments.tasks import ByteTokenizer, save_tokenizer

SRC = Path(__file__).resolve().parents[1] / "src"
LM_EVAL = shutil.which("lm_eval") or str(Path(os.sys.executable).with_name("lm_eval"))
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path(LM_EVAL).is_file(), reason="lm_eval is not installed (pip install tapelm[lm-eval])"),
]

TASK = """task: tapelm_local_sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def _scored_pairs(out: Path) -> list[tuple[str, str, float]]:
    """(context, continuation, log-likelihood) of every request lm_eval made, from its logged samples."""
    (samples,) = out.rglob("samples_tapelm_local_sums_*.jsonl")
    rows = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda row: row["doc_id"])
    return [
        (arguments["arg_0"], arguments["arg_1"], float(response[0][0]))
        for row in rows
        for arguments, response in zip(row["arguments"].values(), row["resps"])
    ]


def _loglikelihood(model: TapeForCausalLM, context: str, continuation: str) -> float:
    """log p(continuation | context) from one unpadded forward pass, with lm_eval's split: trailing spaces of the
    context belong to the continuation (the byte tokenizer's ids are the UTF-8 bytes)."""
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped) :] + continuation
    ids = torch.tensor([list((context + continuation).encode())])
    start = len(context.encode())
    with torch.no_grad():
        log_probs = model(ids[:, :-1]).logits.log_softmax(-1)[0, start - 1 :]
    return log_probs.gather(-1, ids[0, start:, None]).sum().item()


def test_lm_eval_scores_a_saved_model_in_padded_batches_as_the_model_scores_each_request(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TapeForCausalLM(
        TapeConfig(
            vocab_size=257,
            pad_token_id=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
        )
    ).eval()
    model.save_pretrained(tmp_path / "model")
    save_tokenizer(ByteTokenizer(), tmp_path / "model")
    rows = [
        {"context": f"{a} plus {b} is", "choices": [str(a + b), str(a + b + 1), str(a * b)], "answer": 0}
        for a, b in [(1, 2), (3, 4), (10, 5), (7, 7), (2, 9), (12, 30), (25, 17)]
    ]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "sums.yaml").write_text(TASK.format(data=tmp_path / "data.jsonl"))
    environment = {
        **os.environ,
        "PYTHONPATH": str(SRC),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
        "OMP_NUM_THREADS": "1",
    }
    command = [
        LM_EVAL,
        "--model",
        "hf",
        "--model_args",
        f"pretrained={tmp_path / 'model'},trust_remote_code=True,dtype=float32",
        "--tasks",
        "tapelm_local_sums",
        "--include_path",
        str(tmp_path / "tasks"),
        "--batch_size",
        "4",  # requests of unequal length share a batch: lm_eval pads them
        "--device",
        "cpu",
        "--output_path",
        str(tmp_path / "out"),
        "--log_samples",
    ]
    run = subprocess.run(command, env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    scored = _scored_pairs(tmp_path / "out")
    assert len(scored) == 3 * len(rows) and len({len(c + x) for c, x, _ in scored}) > 1
    expected = [_loglikelihood(model, context, continuation) for context, continuation, _ in scored]
    torch.testing.assert_close(torch.tensor([s for *_, s in scored]), torch.tensor(expected), rtol=1e-5, atol=1e-5)
