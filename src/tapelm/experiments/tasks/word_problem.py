"""The word problem over a permutation group: state tracking (Merrill et al. 2024, "The illusion of state";
Liu et al. 2023, "Transformers learn shortcuts to automata").

Group elements are permutations of {0, ..., n-1} in one-line notation, enumerated in lexicographic order
(`itertools.permutations`, so the identity is element 0); the token of element p is "p" followed by its images,
e.g. `p021` in S3 maps 0->0, 1->2, 2->1. Composition is explicit: (p ∘ q)(i) = p(q(i)), q applied first, and the
state after t elements is

    s_0 = e,   s_t = s_{t-1} ∘ g_t   (so s_t = g_1 ∘ g_2 ∘ ... ∘ g_t; as permutation matrices with P_p e_i = e_p(i),
                                     P_{s_t} = P_{g_1} P_{g_2} ... P_{g_t}).

An example is `<bos> g_1 ... g_T <eos>` with every g_t uniform over the group. It is a tagging task: the label of
token t + 1 is s_t, so the model predicts the running product s_t at the position of g_t, having seen only
g_1..g_t (never an earlier product: with the products in the input, teacher forcing would reduce the task to one
composition with the previous product). The <eos> only carries the last label. The loss covers all T labels; the
metric is exact match of the whole sequence of products, with the share of products right (token accuracy) beside
it. Training sequences all have num_elements elements; conditions multiply it (T..4T by default). At these lengths
a test sequence equals a training one with negligible probability (|G|^-T), so no hold-out split is needed; the
test data come from their own generator (`eval_rng`), not the training stream.

Groups: S3 (order 6, solvable), S4 and A4 (solvable), A5 (order 60, the smallest non-solvable group: its word
problem is NC1-complete, so no fixed-depth transformer solves it at every length under standard conjectures) and
S5 (order 120, non-solvable).
"""

from __future__ import annotations

import itertools
from functools import cached_property
from typing import Any

import numpy as np

from ...data.tokenization import SymbolTokenizer
from .base import Example, ScaledTask
from .options import check_choice, check_int, check_multipliers

GROUPS = {"S3": 3, "S4": 4, "A4": 4, "S5": 5, "A5": 5}


def is_even(permutation: tuple[int, ...]) -> bool:
    """Whether the permutation has an even number of inversions."""
    inversions = sum(a > b for a, b in itertools.combinations(permutation, 2))
    return inversions % 2 == 0


def group_elements(group: str) -> list[tuple[int, ...]]:
    """The elements of `group` as permutations in one-line notation, in lexicographic order (identity first)."""
    degree = GROUPS[check_choice("group", group, GROUPS)]
    elements = list(itertools.permutations(range(degree)))
    return [p for p in elements if is_even(p)] if group.startswith("A") else elements


def compose(p: tuple[int, ...], q: tuple[int, ...]) -> tuple[int, ...]:
    """p ∘ q: apply q first, then p."""
    return tuple(p[i] for i in q)


def multiplication_table(elements: list[tuple[int, ...]]) -> np.ndarray:
    """table[i, j] = index of elements[i] ∘ elements[j]; raises ValueError if the set is not closed."""
    index = {p: i for i, p in enumerate(elements)}
    table = np.empty((len(elements), len(elements)), dtype=np.int64)
    for i, p in enumerate(elements):
        for j, q in enumerate(elements):
            product = compose(p, q)
            if product not in index:
                raise ValueError(f"{p} ∘ {q} = {product} is not in the set: not a group")
            table[i, j] = index[product]
    return table


def running_products(table: np.ndarray, sequence: np.ndarray) -> np.ndarray:
    """s_t = s_{t-1} ∘ g_t from s_0 = identity (element 0), as element indices; same shape as `sequence`."""
    states = np.empty_like(sequence)
    state = 0
    for t, element in enumerate(sequence):
        state = table[state, element]
        states[t] = state
    return states


def element_token(permutation: tuple[int, ...]) -> str:
    return "p" + "".join(map(str, permutation))


class WordProblemTask(ScaledTask):
    name = "word_problem"

    @classmethod
    def reading_notes(cls, options: dict[str, Any], token_accuracy: bool) -> list[str]:
        if not token_accuracy:
            return []
        group = options.get("group", "S3")
        return [
            f"Word-problem token accuracy is the share of running products right; guessing gives "
            f"1/|{group}| = {100 / len(group_elements(group)):.1f}%. A longer sequence starts with as many "
            "products as training had, so its token accuracy stays above chance even for a model that "
            "tracks nothing beyond the training length; exact match needs every product right."
        ]

    size_name = "num_elements"
    metric_name = "exact_match"
    tagging = True

    def __init__(
        self, group: str = "S3", num_elements: int = 16, eval_multipliers: tuple[int, ...] = (1, 2, 3, 4)
    ) -> None:
        self.group = check_choice("group", group, GROUPS)
        self.num_elements = check_int("num_elements", num_elements, 1, 10**5)
        self.eval_multipliers = check_multipliers("eval_multipliers", eval_multipliers)
        self.min_train_size = self.num_elements  # every training sequence has exactly T elements
        self.elements = group_elements(self.group)
        self.tokenizer = SymbolTokenizer([element_token(p) for p in self.elements])
        self.train_length = self.sequence_length(self.num_elements)

    @cached_property
    def table(self) -> np.ndarray:
        """The multiplication table over element indices (table[i, j] = i ∘ j)."""
        return multiplication_table(self.elements)

    @property
    def first_element_id(self) -> int:
        """The token id of element 0 (element i has id first_element_id + i)."""
        return len(self.tokenizer.symbols) - len(self.elements)

    @property
    def train_size(self) -> int:
        return self.num_elements

    def sequence_length(self, size: int) -> int:
        return size + 2

    def example(self, rng: np.random.Generator, num_elements: int) -> Example:
        sequence = rng.integers(0, len(self.elements), size=num_elements)
        states = running_products(self.table, sequence)
        first = self.first_element_id
        ids = [self.tokenizer.bos_id, *(sequence + first).tolist(), self.tokenizer.eos_id]
        labels = [self.tokenizer.pad_id, self.tokenizer.pad_id, *(states + first).tolist()]
        return Example(ids, [False, False] + [True] * num_elements, labels)


__all__ = [
    "WordProblemTask",
    "GROUPS",
    "group_elements",
    "compose",
    "multiplication_table",
    "running_products",
    "is_even",
]
