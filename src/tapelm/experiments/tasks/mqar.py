"""Multi-query associative recall (Arora et al., Zoology).

`<bos> k v k v ... k v  k v k v ...`: num_pairs distinct keys each bound to a value, then every key again
in a random order, each followed by its value. Keys ("k0", "k1", ...) and values ("v0", ...) are disjoint
vocabularies. The loss and the metric ("accuracy": the fraction of queries answered) cover the values
in the query half. Training draws the number of pairs uniformly from min_pairs..num_pairs (default 1..num_pairs);
conditions multiply num_pairs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...data.tokenization import BOS, SymbolTokenizer
from .base import Example, ScaledTask
from .options import check_int, check_multipliers


class MQARTask(ScaledTask):
    name = "mqar"

    @classmethod
    def reading_notes(cls, options: dict[str, Any], token_accuracy: bool) -> list[str]:
        pairs = [options.get("num_pairs", 8) * m for m in options.get("eval_multipliers", (1, 2, 4))]
        guesses = (sum(1 / k for k in range(1, n + 1)) / n for n in pairs)
        return [
            "MQAR accuracy is the share of queries answered. A model that has learned the format but not "
            "recall, answering each query with a value not yet asked for, scores H(n)/n for n pairs (H the "
            "harmonic number): " + ", ".join(f"{100 * g:.1f}% at {n}" for g, n in zip(guesses, pairs)) + "."
        ]

    size_name = "num_pairs"
    metric_name = "accuracy"

    def __init__(
        self,
        num_pairs: int = 8,
        num_keys: int = 64,
        num_values: int = 64,
        eval_multipliers: tuple[int, ...] = (1, 2, 4),
        min_pairs: int = 1,
    ) -> None:
        self.num_pairs = check_int("num_pairs", num_pairs, 1, 4096)
        self.min_train_size = check_int("min_pairs", min_pairs, 1, self.num_pairs)
        self.eval_multipliers = check_multipliers("eval_multipliers", eval_multipliers)
        most_pairs = self.num_pairs * self.eval_multipliers[-1]
        self.num_keys = check_int("num_keys", num_keys, most_pairs, 100_000)
        self.num_values = check_int("num_values", num_values, 2, 100_000)
        self.tokenizer = SymbolTokenizer(
            [f"k{i}" for i in range(self.num_keys)] + [f"v{i}" for i in range(self.num_values)]
        )
        self.train_length = self.sequence_length(self.num_pairs)

    @property
    def train_size(self) -> int:
        return self.num_pairs

    def sequence_length(self, size: int) -> int:
        return 1 + 4 * size

    def example(self, rng: np.random.Generator, num_pairs: int) -> Example:
        keys = rng.choice(self.num_keys, size=num_pairs, replace=False)
        values = rng.integers(0, self.num_values, size=num_pairs)
        context = "".join(f"k{k}v{v}" for k, v in zip(keys, values))
        segments = [(BOS + context, False)]
        for query in rng.permutation(num_pairs):
            segments += [(f"k{keys[query]}", False), (f"v{values[query]}", True)]
        return Example.from_segments(self.tokenizer, segments)
