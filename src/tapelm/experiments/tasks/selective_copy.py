"""Selective copy (Gu & Dao, Mamba): `<bos> ..c...a.c.. | cac <eos>`.

num_tokens data letters are scattered among noise "." in a region of region_length tokens; after "|"
the data letters come again in order, then <eos> (the loss target). Training draws the region length
uniformly from num_tokens..region_length; conditions multiply region_length.
"""

from __future__ import annotations

import string

import numpy as np

from ...data.tokenization import BOS, EOS, SymbolTokenizer
from .base import Example, ScaledTask
from .options import check_int, check_multipliers

NOISE, SEPARATOR = ".", "|"


class SelectiveCopyTask(ScaledTask):
    name = "selective_copy"
    size_name = "region_length"

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
        self.train_length = self.sequence_length(self.region_length)

    @property
    def min_train_size(self) -> int:
        return self.num_tokens

    @property
    def train_size(self) -> int:
        return self.region_length

    def sequence_length(self, size: int) -> int:
        return 1 + size + 1 + self.num_tokens + 1

    def example(self, rng: np.random.Generator, region_length: int) -> Example:
        data = rng.choice(list(self.alphabet), size=self.num_tokens)
        region = np.full(region_length, NOISE)
        region[np.sort(rng.choice(region_length, size=self.num_tokens, replace=False))] = data
        prompt = BOS + "".join(region) + SEPARATOR
        return Example.from_segments(self.tokenizer, [(prompt, False), ("".join(data) + EOS, True)])
