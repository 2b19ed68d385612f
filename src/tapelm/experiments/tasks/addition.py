"""Addition with reversed digits (TAPE.md §7): 123+45=168 is the sequence `<bos>321+54=861<eos>`.

The loss covers the answer digits and <eos>. Training draws (len_a, len_b) uniformly from 1..max_train_digits
each, then the digits uniformly (no leading zero unless the operand has one digit). Evaluation is the grid of
(len_a, len_b) cells up to eval_max_digits. Problems with both lengths in the training range are split by a
fixed hash (`held_out`), so no evaluation problem is ever a training problem.

`format="index_hints"` puts a marker of its significance before every digit, the same marker in both operands and
the answer (index hints: Nogueira et al. 2021; Zhou et al. 2024, "Transformers Can Achieve Length Generalization But
Not Robustly"), so a digit's partners can be found by content instead of by position: 123+45 with hints starting at
<5> is `<bos><5>3<6>2<7>1+<5>5<6>4=<5>8<6>6<7>1<eos>`. As in Zhou et al., each problem's hints are a run of
consecutive markers from an ordered set of `hint_symbols` markers, starting at a random offset, so training on short
operands still shows every marker, and longer operands need only longer runs of markers already seen. The answer's
markers are targets too (generation has to write them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...data.tokenization import BOS, EOS, SymbolTokenizer
from .base import Condition, Example, SyntheticTask, held_out
from .options import check_choice, check_int

FORMATS = ("plain", "index_hints")


def random_operands(rng: np.random.Generator, len_a: int, len_b: int) -> tuple[str, str]:
    """Two uniform decimal strings of these lengths, without a leading zero unless one digit long."""
    lows = np.zeros(len_a + len_b)
    lows[[0, len_a]] = [len_a > 1, len_b > 1]
    digits = (lows + rng.random(len_a + len_b) * (10 - lows)).astype(np.uint8) + ord("0")
    digits = digits.tobytes().decode()
    return digits[:len_a], digits[len_a:]


def hint(index: int) -> str:
    """The marker of significance `index` (counted from the first hint of the problem's run)."""
    return f"<{index}>"


def with_hints(reversed_digits: str, first_hint: int) -> str:
    """Reversed digits with the markers first_hint, first_hint + 1, ... before them."""
    return "".join(hint(first_hint + i) + digit for i, digit in enumerate(reversed_digits))


def format_problem(a: str, b: str, first_hint: int | None = None) -> tuple[str, str]:
    """(prompt, answer) texts for the decimal strings a + b, with every number reversed; with index hints starting at
    `first_hint` when it is given."""
    numbers = a[::-1], b[::-1], str(int(a) + int(b))[::-1]
    if first_hint is not None:
        numbers = tuple(with_hints(n, first_hint) for n in numbers)
    return f"{BOS}{numbers[0]}+{numbers[1]}=", f"{numbers[2]}{EOS}"


def sequence_length(len_a: int, len_b: int, hints: bool = False) -> int:
    """The longest token count of a problem with these operand lengths."""
    digits = len_a + len_b + max(len_a, len_b) + 1
    return 4 + (2 * digits if hints else digits)


class AdditionTask(SyntheticTask):
    name = "addition"
    evaluation_options = ("eval_max_digits",)

    @classmethod
    def reading_notes(cls, options: dict[str, Any], token_accuracy: bool) -> list[str]:
        if not token_accuracy:
            return []
        return [
            "Token accuracy on longer operands counts mostly the first (least significant) answer digits, "
            "so it measures partial length generalisation, not the ability to add longer numbers."
        ]

    def __init__(
        self,
        max_train_digits: int = 10,
        eval_max_digits: int | None = None,
        format: str = "plain",
        hint_symbols: int | None = None,
    ) -> None:
        self.max_train_digits = check_int("max_train_digits", max_train_digits, 1, 100)
        default_eval = 2 * self.max_train_digits
        self.eval_max_digits = check_int("eval_max_digits", eval_max_digits or default_eval, 1, 200)
        self.format = check_choice("format", format, FORMATS)
        self.hints = self.format == "index_hints"
        longest_answer = max(self.max_train_digits, self.eval_max_digits) + 1
        if hint_symbols is not None and not self.hints:
            raise ValueError(
                f"hint_symbols={hint_symbols!r} is not allowed with format={format!r}; it needs format='index_hints'"
            )
        self.hint_symbols = check_int("hint_symbols", hint_symbols or 2 * longest_answer, longest_answer, 1000)
        markers = [hint(i) for i in range(self.hint_symbols)] if self.hints else []
        self.tokenizer = SymbolTokenizer([*"0123456789+=", *markers])
        self.train_length = sequence_length(self.max_train_digits, self.max_train_digits, self.hints)

    def eval_conditions(self) -> list[Condition]:
        cells = range(1, self.eval_max_digits + 1)
        return [{"len_a": a, "len_b": b, "length": sequence_length(a, b, self.hints)} for a in cells for b in cells]

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
                break
        first_hint = None
        if self.hints:  # a run long enough for the longest answer of this cell
            first_hint = int(rng.integers(0, self.hint_symbols - max(len_a, len_b)))
        prompt, answer = format_problem(a, b, first_hint)
        return Example.from_segments(self.tokenizer, [(prompt, False), (answer, True)])
