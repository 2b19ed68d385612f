"""The task interface: batches, collation, seeding, teacher-forced scoring and evaluation."""

from __future__ import annotations

import hashlib
import json
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np
import torch

from ...data.examples import IGNORE_INDEX, Batch, Example, collate
from ...data.tokenization import Tokenizer
from .options import check_int

# Addition problems and pass keys whose hash is divisible by this are reserved for evaluation.
HOLDOUT_EVERY = 10
TEST_SEED = 1234  # one fixed test set for every training seed: the spread across seeds is the training's
VALIDATION_SEED = 4321  # the validation set: the in-training evaluation's and the tuning's, never the test's

Condition = dict[str, Any]
LogitsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _target_hits(logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(hits, is_target), both (batch, seq - 1): argmax(logits[:, t-1]) == labels[:, t], and labels[:, t] applies."""
    labels = batch.labels.to(logits.device)[:, 1:]
    is_target = labels != IGNORE_INDEX
    hits = (logits[:, :-1].argmax(dim=-1) == labels) & is_target
    return hits, is_target


def exact_match_per_example(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """BoolTensor (batch,): every labelled token is the argmax of the previous position's logits.

    Under teacher forcing this equals exact match of greedy decoding.
    """
    hits, is_target = _target_hits(logits, batch)
    return (hits == is_target).all(dim=1).cpu()


def target_accuracy_per_example(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """FloatTensor (batch,): the fraction of labelled tokens predicted correctly (1.0 when there are none)."""
    hits, is_target = _target_hits(logits, batch)
    counts = is_target.sum(dim=1)
    return torch.where(counts > 0, hits.sum(dim=1) / counts.clamp(min=1), 1.0).float().cpu()


SCORERS = {"exact_match": exact_match_per_example, "accuracy": target_accuracy_per_example}


def eval_rng(seed: int, condition: Condition) -> np.random.Generator:
    """The generator of one evaluation condition: depends on the seed and on every condition field."""
    digest = zlib.crc32(json.dumps(condition, sort_keys=True).encode())
    return np.random.default_rng([seed, digest])


def held_out(key: str) -> bool:
    """Whether the problem named `key` is reserved for evaluation (a fixed hash, about 1 in HOLDOUT_EVERY)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % HOLDOUT_EVERY == 0


def check_eval_sizes(n: int, batch_size: int) -> None:
    """Validate the `n` and `batch_size` arguments of eval_batches."""
    check_int("n", n, 1, 10**9)
    check_int("batch_size", batch_size, 1, 10**9)


class Task(ABC):
    """A task: a tokenizer, a seeded training stream and seeded evaluation conditions.

    Every condition has a "length" field: the longest sequence (in tokens) it produces.
    """

    name: ClassVar[str]
    metric_name: ClassVar[str]
    # True for tagging tasks, whose labels are not the next input tokens (Example.labels); False: labels == ids.
    tagging: ClassVar[bool] = False
    # the options that shape only the evaluation, never the training stream nor the tokenizer: runs that differ in
    # nothing else share one training (`experiments.runs.training_identity`)
    evaluation_options: ClassVar[tuple[str, ...]] = ("eval_multipliers",)
    tokenizer: Tokenizer
    train_length: int  # longest training sequence, in tokens

    @abstractmethod
    def train_batch(self, rng: np.random.Generator, batch_size: int) -> Batch:
        """A training batch drawn from `rng`."""

    def validation_apart(self, n: int) -> bool:
        """Whether a draw of n examples per condition with a seed other than `TEST_SEED` shares nothing with the
        test set by construction (a synthetic task draws afresh; text needs room in its held-out stream)."""
        return True

    @abstractmethod
    def eval_conditions(self) -> list[Condition]:
        """The evaluation grid, e.g. one condition per (len_a, len_b) cell or per (length, depth)."""

    @abstractmethod
    def eval_batches(self, condition: Condition, seed: int, n: int, batch_size: int) -> Iterator[Batch]:
        """The evaluation data of one condition, the same for the same (condition, seed)."""

    @abstractmethod
    def evaluate_condition(
        self, logits_fn: LogitsFn, condition: Condition, seed: int, n: int, batch_size: int
    ) -> tuple[float, int]:
        """(metric value, number of examples or tokens it averages over) for one condition."""

    @classmethod
    def reading_notes(cls, options: dict[str, Any], token_accuracy: bool) -> list[str]:
        """Sentences the report adds to a comparison of this task run with `options`: what its metric (and, when
        `token_accuracy`, its token accuracy) means for reading the numbers. None by default."""
        return []

    @classmethod
    def tokenizer_is_trained(cls, options: dict[str, Any]) -> bool:
        """Whether the task built with `options` learns its tokenizer from data (so a run must keep the one it
        trained with: `get_task`'s saved_tokenizer); the synthetic tasks' vocabularies follow from their options."""
        return False

    def data_record(self) -> dict[str, Any]:
        """What a run records about its data beyond the task's options, so that runs made from other data are not
        counted as one comparison (empty: a synthetic task's data follow from its options and the seeds)."""
        return {}

    def like_training_but_length(self, condition: Condition) -> bool:
        """Whether a condition is drawn as training is in everything but its length (the conditions of a length
        curve; by default every condition)."""
        return True

    def in_distribution(self, condition: Condition) -> bool:
        """Whether a condition is what training drew from (by default: drawn like training and not longer than the
        training sequences)."""
        return self.like_training_but_length(condition) and condition["length"] <= self.train_length

    @property
    def max_eval_length(self) -> int:
        """The longest sequence any evaluation condition produces (for sizing position tables)."""
        return max(condition["length"] for condition in self.eval_conditions())


class SyntheticTask(Task):
    """A task whose examples are generated one at a time; scored per example by `metric_name`."""

    metric_name: ClassVar[str] = "exact_match"

    @abstractmethod
    def train_example(self, rng: np.random.Generator) -> Example:
        """One training example."""

    @abstractmethod
    def eval_example(self, rng: np.random.Generator, condition: Condition) -> Example:
        """One evaluation example of `condition`."""

    def train_batch(self, rng: np.random.Generator, batch_size: int) -> Batch:
        check_int("batch_size", batch_size, 1, 10**9)
        return collate([self.train_example(rng) for _ in range(batch_size)], self.tokenizer.pad_id)

    def eval_batches(self, condition: Condition, seed: int, n: int, batch_size: int) -> Iterator[Batch]:
        check_eval_sizes(n, batch_size)
        rng = eval_rng(seed, condition)
        for start in range(0, n, batch_size):
            size = min(batch_size, n - start)
            yield collate([self.eval_example(rng, condition) for _ in range(size)], self.tokenizer.pad_id)

    def score(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Per-example correctness in [0, 1]: exact match, or the fraction of targets right for "accuracy"."""
        return SCORERS[self.metric_name](logits, batch)

    @torch.no_grad()
    def evaluate_condition(
        self, logits_fn: LogitsFn, condition: Condition, seed: int, n: int, batch_size: int
    ) -> tuple[float, int]:
        scores = [
            self.score(logits_fn(batch.input_ids, batch.attention_mask), batch)
            for batch in self.eval_batches(condition, seed, n, batch_size)
        ]
        return torch.cat(scores).float().mean().item(), n


class ScaledTask(SyntheticTask):
    """A task whose examples grow with one integer size: training draws the size uniformly from
    min_train_size..train_size, condition k evaluates at train_size x eval_multipliers[k]."""

    size_name: ClassVar[str]
    min_train_size: int = 1
    eval_multipliers: tuple[int, ...]

    @property
    @abstractmethod
    def train_size(self) -> int:
        """The largest size seen in training."""

    @abstractmethod
    def sequence_length(self, size: int) -> int:
        """Tokens in an example of this size."""

    @abstractmethod
    def example(self, rng: np.random.Generator, size: int) -> Example:
        """One example of this size."""

    def eval_conditions(self) -> list[Condition]:
        sizes = [self.train_size * multiplier for multiplier in self.eval_multipliers]
        return [{self.size_name: size, "length": self.sequence_length(size)} for size in sizes]

    def train_example(self, rng: np.random.Generator) -> Example:
        return self.example(rng, int(rng.integers(self.min_train_size, self.train_size + 1)))

    def eval_example(self, rng: np.random.Generator, condition: Condition) -> Example:
        return self.example(rng, condition[self.size_name])


def evaluate_task(
    task: Task, logits_fn: LogitsFn, seed: int = 0, n_per_condition: int = 100, batch_size: int = 32
) -> dict[str, Any]:
    """Run every condition of `task`; `logits_fn(input_ids, attention_mask)` returns (batch, seq, vocab) logits.

    Returns {"task", "metric", "conditions": [{**condition, "value", "n"}], "mean"}. Put the model in eval mode first.
    """
    conditions = []
    for condition in task.eval_conditions():
        value, n = task.evaluate_condition(logits_fn, condition, seed, n_per_condition, batch_size)
        conditions.append({**condition, "value": value, "n": n})
    mean = float(np.mean([row["value"] for row in conditions]))
    return {"task": task.name, "metric": task.metric_name, "conditions": conditions, "mean": mean}
