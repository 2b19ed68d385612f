"""Task evaluation over lengths: run every evaluation condition of a task on a model, summarise by length, and
plot it (a heatmap for addition, the metric against length for the other tasks)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from .tasks import (
    TEST_SEED,
    VALIDATION_SEED,
    SyntheticTask,
    Task,
    exact_match_per_example,
    target_accuracy_per_example,
)

EVAL_SEED = TEST_SEED  # the test set's seed (`tasks.base`); VALIDATION_SEED the validation set's


@contextmanager
def seeded_torch_rng(seed: int, device: torch.device) -> Iterator[None]:
    """torch's random state seeded for one evaluation and restored afterwards: RandPE draws its evaluation positions
    from it, so an evaluation is reproducible and leaves a training run's random stream untouched."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def length_key(task: Task, condition: dict[str, Any]) -> int:
    """The x value of the metric-against-length curve (addition: the longer operand's digit count)."""
    if task.name == "addition":
        return max(condition["len_a"], condition["len_b"])
    return condition["length"]


def length_label(task: Task) -> str:
    if task.name == "addition":
        return "digits of the longer operand"
    if task.name == "text" or getattr(task.tokenizer, "vocab_size", 0) != 257:
        return "evaluation length (tokens)"
    return "evaluation length (bytes)"


def training_edge(task: Task) -> float:
    """The last in-distribution x value (drawn as a line on the curves)."""
    return task.max_train_digits if task.name == "addition" else task.train_length


def _mean(values: list[float], metric: str) -> float:
    if not values:
        return float("nan")
    if metric == "perplexity":  # average log-perplexity, reported as a perplexity
        return float(math.exp(np.mean(np.log(values))))
    return float(np.mean(values))


def summarize(task: Task, conditions: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    """Headline numbers: the mean over all conditions ('all', the paper's heatmap average for addition), over the
    in-distribution ones and over the longer ones, the metric per length (mean over other condition fields), and how
    many test examples each headline number rests on."""
    headlines = {
        "all": conditions,
        "in_distribution": [c for c in conditions if task.in_distribution(c)],
        "longer": [c for c in conditions if not task.in_distribution(c)],
    }
    groups: dict[int, list[float]] = defaultdict(list)
    for c in conditions:
        groups[length_key(task, c)].append(c["value"])
    return {
        **{key: _mean([c["value"] for c in group], metric) for key, group in headlines.items()},
        "by_length": {str(k): _mean(v, metric) for k, v in sorted(groups.items())},
        "examples": {key: int(sum(c.get("n", 0) for c in group)) for key, group in headlines.items()},
    }


@torch.no_grad()
def evaluate_model(
    model: torch.nn.Module, task: Task, n: int, batch_size: int, seed: int = EVAL_SEED, progress: bool = True
) -> dict[str, Any]:
    """Every condition of `task` on `model` (put in eval mode here): {"task", "metric", "conditions", "mean",
    "summary", "seed", "n"}; the same data as `tasks.evaluate_task` with the same seed, plus a progress bar."""
    model.eval()
    device = next(model.parameters()).device

    def logits_fn(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
        return out.logits.float()

    conditions = []
    secondary = isinstance(task, SyntheticTask) and task.metric_name == "exact_match"
    with seeded_torch_rng(seed, device):
        for condition in tqdm(
            task.eval_conditions(), desc=f"eval {task.name}", disable=not progress, dynamic_ncols=True
        ):
            if secondary:
                row = _score_both(task, logits_fn, condition, seed, n, batch_size)
            else:
                value, count = task.evaluate_condition(logits_fn, condition, seed, n, batch_size)
                row = {"value": value, "n": count}
            conditions.append({**condition, **row})
    mean = float(np.mean([row["value"] for row in conditions]))
    evaluation = {
        "task": task.name,
        "metric": task.metric_name,
        "seed": seed,
        "n": n,
        "conditions": conditions,
        "mean": mean,
        "summary": summarize(task, conditions, task.metric_name),
        "x_label": length_label(task),
        "training_edge": training_edge(task),
    }
    if secondary:
        tokens = [{**c, "value": c["token_accuracy"]} for c in conditions]
        evaluation["token_accuracy_summary"] = summarize(task, tokens, "accuracy")
    return evaluation


def _score_both(task: SyntheticTask, logits_fn, condition, seed: int, n: int, batch_size: int) -> dict[str, Any]:
    """Exact match (the task's metric, identical to task.evaluate_condition) and, from the same logits, the share of
    answer tokens predicted right: a graded signal where exact match is still near zero (tiny models)."""
    exact, tokens = [], []
    for batch in task.eval_batches(condition, seed, n, batch_size):
        logits = logits_fn(batch.input_ids, batch.attention_mask)
        exact.append(exact_match_per_example(logits, batch))
        tokens.append(target_accuracy_per_example(logits, batch))
    return {
        "value": torch.cat(exact).float().mean().item(),
        "n": n,
        "token_accuracy": torch.cat(tokens).float().mean().item(),
    }


def plot_evaluation(evaluation: dict[str, Any], path: Path, title: str) -> Path:
    """A heatmap (addition) or a metric-against-length curve of one evaluation."""
    from ..analysis.plots import curves, heatmap

    if evaluation["task"] == "addition":
        heatmap(evaluation["conditions"], path, title, edge=evaluation["training_edge"])
    else:
        by_length = evaluation["summary"]["by_length"]
        xs = [float(x) for x in by_length]
        curves(
            {title: (xs, list(by_length.values()), None)},
            path,
            title,
            evaluation["x_label"],
            evaluation["metric"],
            edge=evaluation["training_edge"],
        )
    return path


__all__ = ["evaluate_model", "summarize", "EVAL_SEED", "VALIDATION_SEED", "plot_evaluation"]
