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


def _loglikelihoods(out: Path) -> list[float]:
    (samples,) = out.rglob("samples_tapelm_local_sums_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    return [float(resp[0][0]) for row in sorted(rows, key=lambda r: r["doc_id"]) for resp in row["resps"]]


def test_lm_eval_scores_a_saved_model_alike_at_batch_sizes_1_and_4(tmp_path: Path) -> None:
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
    )
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
    runs = {}
    for batch_size in (1, 4):  # the two evaluations run side by side: each is mostly lm_eval's start
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
            str(batch_size),
            "--device",
            "cpu",
            "--output_path",
            str(tmp_path / f"out{batch_size}"),
            "--log_samples",
        ]
        with open(tmp_path / f"log{batch_size}", "w") as log:  # a file, not a pipe: neither run waits on a reader
            runs[batch_size] = subprocess.Popen(command, env=environment, cwd=tmp_path, stdout=log, stderr=log)
    scores = {}
    for batch_size, run in runs.items():
        assert run.wait(timeout=600) == 0, (tmp_path / f"log{batch_size}").read_text()[-3000:]
        scores[batch_size] = _loglikelihoods(tmp_path / f"out{batch_size}")
    assert len(scores[1]) == 3 * len(rows) and all(score < 0 for score in scores[1])
    torch.testing.assert_close(torch.tensor(scores[4]), torch.tensor(scores[1]), rtol=1e-5, atol=1e-5)
