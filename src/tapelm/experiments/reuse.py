"""One training for comparisons that differ only in their evaluation: a run of a comparison whose training identity
(`runs.training_identity`) equals that of a finished run, with its model, in another comparison of its task under
the same root, on the same tokenizer and data (`Task.data_record`), takes that run's model and is evaluated, not
trained (`tapelm compare`).

The run then holds the model (under its own config: the position limits its evaluation sizes), the training's
metrics.jsonl, its own evaluation and a result.json with the training's record (losses, seconds, as earlier
sessions' training), `trained_in` naming the comparison folder that trained it (a name, not a path)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from ..modeling import TapeForCausalLM
from ..training.atomic import write_json_atomically
from ..training.saved_models import load_saved_model
from .evaluate import evaluate_model
from .runs import (
    EVALUATION_FIELDS,
    RESULT_FILE,
    RUN_FILE,
    ResolvedRun,
    eager,
    run_record,
    training_identity,
    write_evaluation,
)
from .tasks import has_saved_tokenizer, is_saved_in, save_tokenizer


def trained_elsewhere(run: ResolvedRun, run_dir: Path) -> Path | None:
    """The folder of a finished run with its model, in another comparison beside the one `run_dir`
    (COMPARISON/PE/seedS) belongs to, that trained what `run` would train on `run`'s tokenizer and data; None when
    there is none (the first in name order where there are several)."""
    comparison = run_dir.parents[1]
    wanted = training_identity(run.identity)
    for other in sorted(path for path in comparison.parent.iterdir() if path.is_dir() and path != comparison):
        candidate = other / run_dir.parent.name / run_dir.name
        if not ((candidate / RESULT_FILE).is_file() and (candidate / "model" / "config.json").is_file()):
            continue
        try:
            saved = json.loads((candidate / RESULT_FILE).read_text())
            same = training_identity(saved["identity"]) == wanted
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # an unreadable record trains nothing for another comparison
        same = same and saved.get("data", {}) in ({}, run.task.data_record())  # the same corpus, where recorded
        model = candidate / "model"
        if same and has_saved_tokenizer(model) and is_saved_in(run.task.tokenizer, model):
            return candidate
    return None


def evaluate_trained_elsewhere(source: Path, run: ResolvedRun, run_dir: Path, command: str) -> dict[str, Any]:
    """Write `run_dir` as the finished run `run` from the model trained in `source` (`trained_elsewhere`): the model
    saved under `run`'s config, the training's metrics, `run`'s own evaluation; returns its result."""
    trained = json.loads((source / RESULT_FILE).read_text())
    model = load_saved_model(source / "model", TapeForCausalLM, config=run.config)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomically(run_dir / RUN_FILE, {**run_record(run), "command": command})
    save_tokenizer(run.task.tokenizer, run_dir)
    model.save_pretrained(run_dir / "model")
    save_tokenizer(run.task.tokenizer, run_dir / "model")
    shutil.copyfile(source / "metrics.jsonl", run_dir / "metrics.jsonl")
    started = time.time()
    evaluation = eager(evaluate_model)(model, run.task, run.preset.eval_n, run.preset.eval_batch_size, progress=False)
    write_evaluation(run, run_dir, evaluation)
    seconds = trained.get("train_seconds_this_session", 0.0) + trained.get("train_seconds_before_this_session", 0.0)
    result = {
        **trained,
        **run_record(run),
        **{key: evaluation.get(key) for key in EVALUATION_FIELDS},
        "trained_in": source.parents[1].name,
        "train_seconds_this_session": 0.0,
        "train_seconds_before_this_session": seconds,
        "eval_seconds": time.time() - started,
    }
    write_json_atomically(run_dir / RESULT_FILE, result)  # last: it marks the run finished
    return result


__all__ = ["evaluate_trained_elsewhere", "trained_elsewhere"]
