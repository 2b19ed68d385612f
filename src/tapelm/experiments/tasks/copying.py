"""Copy: `<bos> abca | abca <eos>`; the loss covers the copy and <eos>.

Training draws the string length uniformly from 1..max_length; conditions multiply max_length.
"""

from __future__ import annotations

import string

import numpy as np

from ...data.tokenization import BOS, EOS, SymbolTokenizer
from .base import Example, ScaledTask
from .options import check_int, check_multipliers

SEPARATOR = "|"


class CopyTask(ScaledTask):
    name = "copy"
    size_name = "copy_length"

    def __init__(
        self, max_length: int = 16, alphabet_size: int = 16, eval_multipliers: tuple[int, ...] = (1, 2, 4)
    ) -> None:
        self.max_length = check_int("max_length", max_length, 1, 10**6)
        self.alphabet = string.ascii_lowercase[: check_int("alphabet_size", alphabet_size, 2, 26)]
        self.eval_multipliers = check_multipliers("eval_multipliers", eval_multipliers)
        self.tokenizer = SymbolTokenizer([*self.alphabet, SEPARATOR])
        self.train_length = self.sequence_length(self.max_length)

    @property
    def train_size(self) -> int:
        return self.max_length

    def sequence_length(self, size: int) -> int:
        return 2 * size + 3

    def example(self, rng: np.random.Generator, copy_length: int) -> Example:
        text = "".join(rng.choice(list(self.alphabet), size=copy_length))
        return Example.from_segments(self.tokenizer, [(BOS + text + SEPARATOR, False), (text + EOS, True)])
