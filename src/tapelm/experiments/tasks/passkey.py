"""Passkey retrieval (TAPE.md §7) and its multi-key variant, as UTF-8 bytes.

A document is the task line, filler sentences cycling through FILLER, the key line(s) at their depths (as
a fraction of the filler sentences before them) and the question; the loss target is " K." (the period
marks the end of the key, so a prefix of K is not an exact match). A condition's "length" is a bound in
bytes: the filler is as many whole sentences as fit. Keys are uniform in [1, 50000); keys are split by
a fixed hash (`held_out`) so no evaluation key is a training key.

Multi-key documents hold one labelled key line per label ("The pass key for blue is K. ...") and ask for
one of them; the queried line sits at the condition's depth, the others at uniform random depths.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...data.passkey_text import KEY_HIGH, KEY_LOW, LABELS, compose, key_line, question
from ...data.tokenization import ByteTokenizer
from .base import Condition, Example, SyntheticTask, held_out
from .options import check_fractions, check_int, check_multipliers

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


class PasskeyTask(SyntheticTask):
    name = "passkey"
    evaluation_options = ("eval_multipliers", "depths")

    @classmethod
    def reading_notes(cls, options: dict[str, Any], token_accuracy: bool) -> list[str]:
        if not token_accuracy:
            return []
        return [
            "Passkey token accuracy includes the space and the closing period of the answer ' K.', 2 of "
            "its (mostly 7) tokens: an encoding near 30% on it may retrieve no digit at all."
        ]

    labels: tuple[str | None, ...] = (None,)

    def __init__(
        self,
        train_length: int = 512,
        eval_multipliers: tuple[int, ...] = (1, 2, 4),
        depths: tuple[float, ...] = DEPTHS,
    ) -> None:
        self.tokenizer = ByteTokenizer()
        self.min_length = self._shortest_document()
        self.train_length = check_int("train_length", train_length, self.min_length, 10**6)
        self.eval_multipliers = check_multipliers("eval_multipliers", eval_multipliers)
        self.depths = check_fractions("depths", depths)

    def eval_conditions(self) -> list[Condition]:
        return [
            {"length": self.train_length * multiplier, "depth": depth}
            for multiplier in self.eval_multipliers
            for depth in self.depths
        ]

    def train_example(self, rng: np.random.Generator) -> Example:
        length = int(rng.integers(self.min_length, self.train_length + 1))
        return self._example(rng, length, float(rng.random()), want_held_out=False)

    def eval_example(self, rng: np.random.Generator, condition: Condition) -> Example:
        return self._example(rng, condition["length"], condition["depth"], want_held_out=True)

    def _example(self, rng: np.random.Generator, length: int, depth: float, want_held_out: bool) -> Example:
        keys: list[int] = []
        while len(keys) < len(self.labels):
            key = int(rng.integers(KEY_LOW, KEY_HIGH))
            if held_out(str(key)) == want_held_out and key not in keys:
                keys.append(key)
        asked = int(rng.integers(len(self.labels)))
        depths = [depth if i == asked else float(rng.random()) for i in range(len(self.labels))]
        needles = [(d, key_line(k, label)) for d, k, label in zip(depths, keys, self.labels)]
        answer = f" {keys[asked]}."
        prompt = compose(needles, question(self.labels[asked]), answer, length)
        return Example.from_segments(self.tokenizer, [(prompt, False), (answer, True)])

    def _shortest_document(self) -> int:
        """Bytes of a document with no filler and the longest keys and labels."""
        longest = max(self.labels, key=lambda label: len(label or ""))
        needles = [(0.0, key_line(KEY_HIGH - 1, label)) for label in self.labels]
        answer = f" {KEY_HIGH - 1}."
        return len(compose(needles, question(longest), answer, 0)) + len(answer)


class MultiKeyTask(PasskeyTask):
    name = "multikey"

    def __init__(
        self,
        num_keys: int = 3,
        train_length: int = 512,
        eval_multipliers: tuple[int, ...] = (1, 2, 4),
        depths: tuple[float, ...] = DEPTHS,
    ) -> None:
        self.labels = LABELS[: check_int("num_keys", num_keys, 2, len(LABELS))]
        super().__init__(train_length, eval_multipliers, depths)
