"""Flip-flop language modelling (Liu et al. 2023, "Exposing attention glitches").

`<bos> w 1 i 0 r 1 ...`: num_instructions (instruction, bit) pairs; w writes its bit, i carries a random
bit to ignore, r must be followed by the last written bit. The first instruction is w and the last is r;
the others are i with probability p_ignore, else w or r with equal odds. The loss and the metric
("accuracy": the fraction of reads right) cover the bits after r. Conditions: in-distribution (the
training p_ignore), sparse (0.98) and dense (0.1), each at multiples of the training length.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...data.tokenization import BOS, SymbolTokenizer
from .base import Condition, Example, SyntheticTask
from .options import check_float, check_int, check_multipliers

SPARSE_P_IGNORE, DENSE_P_IGNORE = 0.98, 0.1


def sequence_length(num_instructions: int) -> int:
    return 1 + 2 * num_instructions


class FlipFlopTask(SyntheticTask):
    name = "flipflop"

    @classmethod
    def reading_notes(cls, options: dict[str, Any], token_accuracy: bool) -> list[str]:
        return [
            f"Each 'len' column (and each point of the by-length figure) averages flip-flop's three "
            f"splits at that length: the training ignore rate, sparse (ignore rate {SPARSE_P_IGNORE}) and "
            f"dense ({DENSE_P_IGNORE}); so the column at the training length sits below the in-distribution "
            "number, which is the training split alone."
        ]

    metric_name = "accuracy"

    def __init__(
        self, num_instructions: int = 64, p_ignore: float = 0.8, eval_multipliers: tuple[int, ...] = (1, 2, 4)
    ) -> None:
        self.num_instructions = check_int("num_instructions", num_instructions, 2, 10**6)
        self.p_ignore = check_float("p_ignore", p_ignore, 0.0, 1.0)
        self.eval_multipliers = check_multipliers("eval_multipliers", eval_multipliers)
        self.tokenizer = SymbolTokenizer("wri01")
        self.train_length = sequence_length(self.num_instructions)

    def eval_conditions(self) -> list[Condition]:
        splits = {"in_distribution": self.p_ignore, "sparse": SPARSE_P_IGNORE, "dense": DENSE_P_IGNORE}
        return [
            {
                "split": split,
                "p_ignore": p_ignore,
                "num_instructions": self.num_instructions * multiplier,
                "length": sequence_length(self.num_instructions * multiplier),
            }
            for split, p_ignore in splits.items()
            for multiplier in self.eval_multipliers
        ]

    def like_training_but_length(self, condition: Condition) -> bool:
        """The training p_ignore (sparse and dense are out of distribution at any length)."""
        return condition["split"] == "in_distribution"

    def train_example(self, rng: np.random.Generator) -> Example:
        return self._example(rng, self.num_instructions, self.p_ignore)

    def eval_example(self, rng: np.random.Generator, condition: Condition) -> Example:
        return self._example(rng, condition["num_instructions"], condition["p_ignore"])

    def _example(self, rng: np.random.Generator, num_instructions: int, p_ignore: float) -> Example:
        p_each = (1.0 - p_ignore) / 2
        middle = rng.choice(list("iwr"), size=num_instructions - 2, p=[p_ignore, p_each, p_each])
        segments = [(BOS, False)]
        memory = "0"
        for instruction in ["w", *middle, "r"]:
            bit = memory if instruction == "r" else str(rng.integers(0, 2))
            memory = bit if instruction == "w" else memory
            segments += [(instruction, False), (bit, instruction == "r")]
        return Example.from_segments(self.tokenizer, segments)
