"""Counting, after CoPE's `x ++;` programs (Golovneva et al. 2024).

A program is `<bos>` then num_statements statements over num_variables variables (a, b, c, ...), all
starting at 0. A statement is an increment `a++;` or, with probability p_print, a print `print a=3;`
whose value is the variable's current count in decimal; the last statement is always a print. The loss
and the exact-match metric cover every printed value and its ";". Example: `<bos>a++;b++;a++;print a=2;`
(tokens: <bos> a ++ ; b ++ ; a ++ ; "print " a = 2 ;). Training draws num_statements uniformly from
1..num_statements; conditions multiply it.
"""

from __future__ import annotations

import string

import numpy as np

from ...data.tokenization import BOS, SymbolTokenizer
from .base import Example, ScaledTask
from .options import check_float, check_int, check_multipliers

PRINT = "print "


class CountingTask(ScaledTask):
    name = "counting"
    size_name = "num_statements"

    def __init__(
        self,
        num_statements: int = 32,
        num_variables: int = 3,
        p_print: float = 0.2,
        eval_multipliers: tuple[int, ...] = (1, 2, 4),
    ) -> None:
        self.num_statements = check_int("num_statements", num_statements, 1, 10**5)
        self.variables = string.ascii_lowercase[: check_int("num_variables", num_variables, 1, 10)]
        self.p_print = check_float("p_print", p_print, 0.0, 1.0)
        self.eval_multipliers = check_multipliers("eval_multipliers", eval_multipliers)
        self.tokenizer = SymbolTokenizer([*self.variables, "++", ";", PRINT, "=", *string.digits])
        self.train_length = self.sequence_length(self.num_statements)

    @property
    def train_size(self) -> int:
        return self.num_statements

    def sequence_length(self, size: int) -> int:
        """An upper bound: every statement a print (4 tokens plus the digits of a count below size)."""
        return 1 + size * (4 + len(str(size)))

    def example(self, rng: np.random.Generator, num_statements: int) -> Example:
        counts = dict.fromkeys(self.variables, 0)
        prints = rng.random(num_statements) < self.p_print
        prints[-1] = True
        segments = [(BOS, False)]
        for variable, is_print in zip(rng.choice(list(self.variables), size=num_statements), prints):
            if is_print:
                segments += [(f"{PRINT}{variable}=", False), (f"{counts[variable]};", True)]
            else:
                counts[variable] += 1
                segments.append((f"{variable}++;", False))
        return Example.from_segments(self.tokenizer, segments)
