"""Selective copy (Gu & Dao, Mamba): `<bos> ..c...a.c.. | cac <eos>`.

num_tokens data letters are scattered among noise "." in a region of region_length tokens; after "|"
the data letters come again in order, then <eos> (the loss target). Training draws the region length
uniformly from num_tokens..region_length; conditions multiply region_length.
"""

from __future__ import annotations

import string

import numpy as np

from .base import Condition, Example, SyntheticTask
from .options import check_int, check_multipliers
from .tokenization import BOS, EOS, SymbolTokenizer

NOISE, SEPARATOR = ".", "|"


def sequence_length(region_length: int, num_tokens: int) -> int:
    return 1 + region_length + 1 + num_tokens + 1


class SelectiveCopyTask(SyntheticTask):
    name = "selective_copy"

    def __init__(
        self,
        num_tokens: int = 8,
        region_length: int = 32,
        alphabet_size: int = 16,
        eval_multipliers: tuple[int, ...] = (1, 2, 4),
    ) -> None:
        self.num_tokens = check_int("num_tokens", num_tokens, 1, 10**5)
        self.region_length = check_int("region_length", region_length, self.num_tokens, 10**6)
        self.alphabet = string.ascii_lowercase[: check_int("alphabet_size", alphabet_size, 2, 26)]
        self.eval_multipliers = check_multipliers("eval_multipliers", eval_multipliers)
        self.tokenizer = SymbolTokenizer([*self.alphabet, NOISE, SEPARATOR])
        self.train_length = sequence_length(self.region_length, self.num_tokens)

    def eval_conditions(self) -> list[Condition]:
        regions = [self.region_length * multiplier for multiplier in self.eval_multipliers]
        return [{"region_length": r, "length": sequence_length(r, self.num_tokens)} for r in regions]

    def train_example(self, rng: np.random.Generator) -> Example:
        return self._example(rng, int(rng.integers(self.num_tokens, self.region_length + 1)))

    def eval_example(self, rng: np.random.Generator, condition: Condition) -> Example:
        return self._example(rng, condition["region_length"])

    def _example(self, rng: np.random.Generator, region_length: int) -> Example:
        data = rng.choice(list(self.alphabet), size=self.num_tokens)
        region = np.full(region_length, NOISE)
        region[np.sort(rng.choice(region_length, size=self.num_tokens, replace=False))] = data
        prompt = BOS + "".join(region) + SEPARATOR
        return Example.from_segments(self.tokenizer, [(prompt, False), ("".join(data) + EOS, True)])
