"""RoPE as users run it beyond its training length: a trained model evaluated, without retraining, under one of the
inference-time scalings transformers ships, to the longest length its task evaluates.

- "ntk": NTK-aware scaling (bloc97's; Peng et al. 2023, section 3.1): the base theta times s^(d / (d - 2)), so the
  lowest frequency is interpolated by s and the highest kept.
- "dynamic": transformers' dynamic NTK (`rope_type="dynamic"`): the same base, recomputed for each forward from the
  length it sees, untouched up to the training length.
- "yarn": YaRN (Peng et al. 2023, transformers' `rope_type="yarn"`), from the training length to s times it.

s is the task's longest evaluation length over its training length. The rows that use them are
`variants.AT_EVALUATION` ("rope-yarn": RoPE's trained model with YaRN); `compare` evaluates them from their trained
row's models, paired by seed with the same models, and writes them as runs of their own (result.json with the
trained run's identity, `evaluated_with` and `trained_fingerprint`, eval.json, the training's metrics.jsonl): a row
whose trained model was trained again since is evaluated again."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from ..config import TapeConfig
from ..modeling import TapeForCausalLM
from ..training.atomic import write_json_atomically
from ..training.saved_models import load_saved_model
from ..variants import AT_EVALUATION
from .evaluate import evaluate_model
from .runs import EVALUATION_FIELDS, RESULT_FILE, ResolvedRun, training_fingerprint, write_evaluation

METHODS = ("ntk", "dynamic", "yarn")


def scaling(run: ResolvedRun, method: str) -> dict[str, Any]:
    """What `method` sets for `run`'s task: {"method", "factor": longest evaluation length / training length,
    "original": the training length in tokens}."""
    if method not in METHODS:
        raise ValueError(f"RoPE scaling {method!r} is not allowed; choose from: {', '.join(METHODS)}")
    original = run.task.train_length
    factor = run.task.max_eval_length / original
    if factor <= 1:
        raise ValueError(
            f"task {run.spec.task} evaluates no longer than it trains ({run.task.max_eval_length} tokens): a RoPE "
            f"scaling at evaluation has nothing to extend to; give it longer evaluation lengths"
        )
    return {"method": method, "factor": factor, "original": original}


def scaled_config(config: TapeConfig, applied: dict[str, Any]) -> TapeConfig:
    """A new config (validated as any) equal to a trained model's but for the scaling `applied` (see `scaling`) in
    its `rope_parameters`."""
    fields = config.to_dict()
    rope, factor = dict(fields["rope_parameters"]), applied["factor"]
    if applied["method"] == "ntk":
        rope["rope_theta"] = rope["rope_theta"] * factor ** (config.head_dim / (config.head_dim - 2))
    elif applied["method"] == "dynamic":
        rope.update(rope_type="dynamic", factor=factor)
        fields["max_position_embeddings"] = applied["original"]  # the length up to which the base stays theta
    else:
        rope.update(rope_type="yarn", factor=factor, original_max_position_embeddings=applied["original"])
    return TapeConfig.from_dict({**fields, "rope_parameters": rope})


def check_scaled(run: ResolvedRun, row: str) -> None:
    """Refuse, before any work, a row evaluated under a scaling that `run`'s task or model cannot take."""
    scaled_config(run.config, scaling(run, AT_EVALUATION[row][1]))


def evaluate_scaled(trained_dir: Path, run: ResolvedRun, row: str, run_dir: Path) -> dict[str, Any]:
    """Evaluate the model trained in `trained_dir` (the run `run`) under `row`'s scaling and write `run_dir` as a
    finished run of row `row`; returns its result. ValueError when the trained model is not there (a run restored
    from the archive keeps no model: it must train again)."""
    model_dir = Path(trained_dir) / "model"
    if not (model_dir / "config.json").is_file():
        raise ValueError(
            f"row '{row}' evaluates the model trained in '{trained_dir}', which is not there (the archive keeps no "
            "models); run the comparison without --archive so that it trains again"
        )
    applied = scaling(run, AT_EVALUATION[row][1])
    config = scaled_config(TapeConfig.from_pretrained(str(model_dir)), applied)
    model = load_saved_model(model_dir, TapeForCausalLM, config=config)
    started = time.time()
    evaluation = evaluate_model(model, run.task, run.preset.eval_n, run.preset.eval_batch_size, progress=False)
    trained = json.loads((Path(trained_dir) / RESULT_FILE).read_text())
    result = {
        **trained,
        **{key: evaluation.get(key) for key in EVALUATION_FIELDS},
        "pe": row,
        "evaluated_with": applied,
        "trained_fingerprint": training_fingerprint(trained),
        "eval_seconds": time.time() - started,
        "train_seconds_this_session": 0.0,
        "train_seconds_before_this_session": 0.0,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(trained_dir) / "metrics.jsonl", run_dir / "metrics.jsonl")
    write_evaluation(run, run_dir, evaluation)
    write_json_atomically(run_dir / RESULT_FILE, result)  # last: it marks the run finished
    return result


__all__ = ["METHODS", "check_scaled", "evaluate_scaled", "scaled_config", "scaling"]
