"""Copy: `<bos> abca | abca <eos>`; the loss covers the copy and <eos>.

Training draws the string length uniformly from 1..max_length; conditions multiply max_length.
"""

from __future__ import annotations

import string

import numpy as np

from .base import Condition, Example, SyntheticTask
from .options import check_int, check_multipliers
from .tokenization import BOS, EOS, SymbolTokenizer

SEPARATOR = "|"


def sequence_length(copy_length: int) -> int:
    return 2 * copy_length + 3


class CopyTask(SyntheticTask):
    name = "copy"

    def __init__(
        self, max_length: int = 16, alphabet_size: int = 16, eval_multipliers: tuple[int, ...] = (1, 2, 4)
    ) -> None:
        self.max_length = check_int("max_length", max_length, 1, 10**6)
        self.alphabet = string.ascii_lowercase[: check_int("alphabet_size", alphabet_size, 2, 26)]
        self.eval_multipliers = check_multipliers("eval_multipliers", eval_multipliers)
        self.tokenizer = SymbolTokenizer([*self.alphabet, SEPARATOR])
        self.train_length = sequence_length(self.max_length)

    def eval_conditions(self) -> list[Condition]:
        lengths = [self.max_length * multiplier for multiplier in self.eval_multipliers]
        return [{"copy_length": n, "length": sequence_length(n)} for n in lengths]

    def train_example(self, rng: np.random.Generator) -> Example:
        return self._example(rng, int(rng.integers(1, self.max_length + 1)))

    def eval_example(self, rng: np.random.Generator, condition: Condition) -> Example:
        return self._example(rng, condition["copy_length"])

    def _example(self, rng: np.random.Generator, copy_length: int) -> Example:
        text = "".join(rng.choice(list(self.alphabet), size=copy_length))
        return Example.from_segments(self.tokenizer, [(BOS + text + SEPARATOR, False), (text + EOS, True)])
