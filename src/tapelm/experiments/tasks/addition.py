"""Addition with reversed digits (TAPE.md §7): 123+45=168 is the sequence `<bos>321+54=861<eos>`.

The loss covers the answer digits and <eos>. Training draws (len_a, len_b) uniformly from 1..max_train_digits
each, then the digits uniformly (no leading zero unless the operand has one digit). Evaluation is the grid of
(len_a, len_b) cells up to eval_max_digits. Problems with both lengths in the training range are split by a
fixed hash (`held_out`), so no evaluation problem is ever a training problem.
"""

from __future__ import annotations

import numpy as np

from .base import Condition, Example, SyntheticTask, held_out
from .options import check_int
from .tokenization import BOS, EOS, SymbolTokenizer


def random_operands(rng: np.random.Generator, len_a: int, len_b: int) -> tuple[str, str]:
    """Two uniform decimal strings of these lengths, without a leading zero unless one digit long."""
    lows = np.zeros(len_a + len_b)
    lows[[0, len_a]] = [len_a > 1, len_b > 1]
    digits = (lows + rng.random(len_a + len_b) * (10 - lows)).astype(np.uint8) + ord("0")
    digits = digits.tobytes().decode()
    return digits[:len_a], digits[len_a:]


def format_problem(a: str, b: str) -> tuple[str, str]:
    """(prompt, answer) texts for the decimal strings a + b, with every number reversed."""
    return f"{BOS}{a[::-1]}+{b[::-1]}=", f"{str(int(a) + int(b))[::-1]}{EOS}"


def sequence_length(len_a: int, len_b: int) -> int:
    """The longest token count of a problem with these operand lengths."""
    return 1 + len_a + 1 + len_b + 1 + max(len_a, len_b) + 1 + 1


class AdditionTask(SyntheticTask):
    name = "addition"

    def __init__(self, max_train_digits: int = 10, eval_max_digits: int | None = None) -> None:
        self.max_train_digits = check_int("max_train_digits", max_train_digits, 1, 100)
        default_eval = 2 * self.max_train_digits
        self.eval_max_digits = check_int("eval_max_digits", eval_max_digits or default_eval, 1, 200)
        self.tokenizer = SymbolTokenizer("0123456789+=")
        self.train_length = sequence_length(self.max_train_digits, self.max_train_digits)

    def eval_conditions(self) -> list[Condition]:
        cells = range(1, self.eval_max_digits + 1)
        return [{"len_a": a, "len_b": b, "length": sequence_length(a, b)} for a in cells for b in cells]

    def in_distribution(self, condition: Condition) -> bool:
        """Both operands within the training digits."""
        return max(condition["len_a"], condition["len_b"]) <= self.max_train_digits

    def train_example(self, rng: np.random.Generator) -> Example:
        len_a, len_b = (int(n) for n in rng.integers(1, self.max_train_digits + 1, size=2))
        return self._example(rng, len_a, len_b, want_held_out=False)

    def eval_example(self, rng: np.random.Generator, condition: Condition) -> Example:
        return self._example(rng, condition["len_a"], condition["len_b"], want_held_out=True)

    def _example(self, rng: np.random.Generator, len_a: int, len_b: int, want_held_out: bool) -> Example:
        in_train_range = max(len_a, len_b) <= self.max_train_digits
        while True:
            a, b = random_operands(rng, len_a, len_b)
            if not in_train_range or held_out(f"{a}+{b}") == want_held_out:
                prompt, answer = format_problem(a, b)
                return Example.from_segments(self.tokenizer, [(prompt, False), (answer, True)])
