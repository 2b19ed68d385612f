"""The word problem over permutation groups: the groups are groups, the labels are the running products (checked
with permutation matrices, independently of the task's table), seeding, the loss mask and option errors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tapelm.experiments.tasks import IGNORE_INDEX, get_task
from tapelm.experiments.tasks.word_problem import GROUPS, group_elements, is_even, multiplication_table

ORDERS = {"S3": 6, "S4": 24, "A4": 12, "S5": 120, "A5": 60}


def permutation_matrix(permutation) -> np.ndarray:
    """P with P e_i = e_p(i), so that P_(p∘q) = P_p P_q for (p∘q)(i) = p(q(i))."""
    n = len(permutation)
    matrix = np.zeros((n, n), dtype=np.int64)
    matrix[list(permutation), list(range(n))] = 1
    return matrix


def matrix_running_products(elements, sequence) -> list[int]:
    """Indices of the running products g_1 ∘ ... ∘ g_t, t = 1..T, as products of permutation matrices."""
    matrices = {permutation_matrix(p).tobytes(): i for i, p in enumerate(elements)}
    state = np.eye(len(elements[0]), dtype=np.int64)
    out = []
    for element in sequence:
        state = state @ permutation_matrix(elements[element])
        out.append(matrices[state.tobytes()])
    return out


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_the_tables_are_groups(group: str) -> None:
    elements = group_elements(group)
    table = multiplication_table(elements)  # raises unless closed
    n = len(elements)
    assert n == ORDERS[group] == len(set(elements))
    assert elements[0] == tuple(range(len(elements[0])))  # identity first
    assert elements == sorted(elements)  # deterministic (lexicographic) order
    identity = np.arange(n)
    assert (table[0] == identity).all() and (table[:, 0] == identity).all()
    for row in table:  # Latin square: every element has a unique inverse (left and right)
        assert sorted(row) == list(identity)
    assert all(sorted(table[:, j]) == list(identity) for j in range(n))
    inverses = np.argmax(table == 0, axis=1)
    assert (table[identity, inverses] == 0).all() and (table[inverses, identity] == 0).all()
    # associativity, all triples: (a∘b)∘c == a∘(b∘c)
    left = table[table[:, :, None], np.arange(n)[None, None, :]]  # (a∘b)∘c, indexed [a, b, c]
    right = table[np.arange(n)[:, None, None], table[None, :, :]]  # a∘(b∘c)
    assert (left == right).all()
    # the table is composition with the second argument applied first, as permutation matrices multiply
    for i, j in itertools.product(range(n), repeat=2):
        expected = permutation_matrix(elements[i]) @ permutation_matrix(elements[j])
        assert (permutation_matrix(elements[table[i, j]]) == expected).all()


def test_alternating_groups_hold_only_even_permutations() -> None:
    a5, s5 = group_elements("A5"), group_elements("S5")
    assert all(is_even(p) for p in a5)
    assert set(a5) == {p for p in s5 if round(np.linalg.det(permutation_matrix(p))) == 1}
    assert not is_even((1, 0, 2)) and is_even((1, 2, 0))
    assert not (multiplication_table(group_elements("S3")) == multiplication_table(group_elements("S3")).T).all()


@pytest.mark.parametrize("group", ["S3", "A5", "S5"])
def test_labels_are_the_running_products(group: str) -> None:
    task = get_task("word_problem", group=group, num_elements=12)
    first, size = task.first_element_id, len(task.elements)
    batch = task.train_batch(np.random.default_rng(3), 32)
    assert batch.input_ids.shape == (32, 14) and bool((batch.attention_mask == 1).all())
    for ids, labels in zip(batch.input_ids.tolist(), batch.labels.tolist()):
        assert ids[0] == task.tokenizer.bos_id and ids[-1] == task.tokenizer.eos_id
        sequence = [i - first for i in ids[1:-1]]
        assert all(0 <= g < size for g in sequence)
        assert labels[:2] == [IGNORE_INDEX, IGNORE_INDEX]  # loss mask: nothing to predict before g_1 is seen
        # label at token t + 1 is s_t = g_1 ∘ ... ∘ g_t: predicted at the position of g_t
        assert [label - first for label in labels[2:]] == matrix_running_products(task.elements, sequence)
    symbols = task.tokenizer.symbols
    assert symbols[first:] == ["p" + "".join(map(str, p)) for p in task.elements]


def test_a_known_s3_sequence() -> None:
    task = get_task("word_problem", group="S3", num_elements=2)
    ids = {s: i for i, s in enumerate(task.tokenizer.symbols)}
    # g1 = (0 1) as p102, g2 = (1 2) as p021; s2 = g1 ∘ g2 maps 0->g1(0)=1, 1->g1(2)=2, 2->g1(1)=0: p120
    table = task.table
    e = {p: i for i, p in enumerate(task.elements)}
    assert task.elements[table[e[(1, 0, 2)], e[(0, 2, 1)]]] == (1, 2, 0)
    assert task.elements[table[e[(0, 2, 1)], e[(1, 0, 2)]]] == (2, 0, 1)  # the other order differs
    assert ids["p012"] == task.first_element_id


def test_seeding_and_separate_evaluation_stream() -> None:
    task = get_task("word_problem", group="A5", num_elements=8)
    first = task.train_batch(np.random.default_rng([0, 5]), 8)
    again = task.train_batch(np.random.default_rng([0, 5]), 8)
    assert torch.equal(first.input_ids, again.input_ids) and torch.equal(first.labels, again.labels)
    condition = task.eval_conditions()[0]
    evaluation = next(iter(task.eval_batches(condition, 0, 8, 8)))
    assert not torch.equal(first.input_ids, evaluation.input_ids)
    assert torch.equal(evaluation.input_ids, next(iter(task.eval_batches(condition, 0, 8, 8))).input_ids)


def test_conditions_and_lengths() -> None:
    task = get_task("word_problem", num_elements=10)
    assert task.train_length == 12
    assert task.eval_conditions() == [{"num_elements": n, "length": n + 2} for n in (10, 20, 30, 40)]
    assert task.max_eval_length == 42
    for condition in task.eval_conditions():
        batch = next(iter(task.eval_batches(condition, 1, 4, 4)))
        assert batch.input_ids.shape == (4, condition["length"])
        assert int((batch.labels != IGNORE_INDEX).sum()) == 4 * condition["num_elements"]
    lengths = {task.train_batch(np.random.default_rng(i), 4).input_ids.shape[1] for i in range(5)}
    assert lengths == {12}  # training always at T


def test_metric_counts_every_product() -> None:
    from test_tasks import word_problem_oracle

    task = get_task("word_problem", num_elements=6)
    batch = next(iter(task.eval_batches(task.eval_conditions()[0], 0, 4, 4)))
    logits = word_problem_oracle(task)(batch.input_ids, batch.attention_mask)
    right = task.score(logits, batch)
    assert right.tolist() == [1.0] * 4
    logits[0, 3] = torch.nn.functional.one_hot(torch.tensor(task.tokenizer.pad_id), logits.shape[-1])  # s_3 wrong
    assert task.score(logits, batch).tolist() == [0.0, 1.0, 1.0, 1.0]
    from tapelm.experiments.tasks import target_accuracy_per_example

    assert target_accuracy_per_example(logits, batch)[0].item() == pytest.approx(5 / 6)


@pytest.mark.parametrize(
    ("option", "value", "allowed"),
    [
        ("group", "S6", "one of: S3, S4, A4, S5, A5"),
        ("group", "s3", "one of: S3"),
        ("num_elements", 0, "an integer in"),
        ("num_elements", 2.0, "an integer in"),
        ("eval_multipliers", (), "a non-empty sequence"),
    ],
)
def test_bad_options_raise_one_line_naming_the_option(option: str, value: object, allowed: str) -> None:
    with pytest.raises(ValueError) as error:
        get_task("word_problem", **{option: value})
    message = str(error.value)
    assert message.startswith(f"{option}=") and allowed in message and "\n" not in message


def test_collate_puts_tagging_labels_under_left_padding() -> None:
    from tapelm.experiments.tasks import Example, collate

    batch = collate([Example([1, 5, 6], [False, True, True], [0, 8, 9]), Example([1, 5], [False, True])], 0)
    assert batch.input_ids.tolist() == [[1, 5, 6], [0, 1, 5]]
    assert batch.labels.tolist() == [[IGNORE_INDEX, 8, 9], [IGNORE_INDEX, IGNORE_INDEX, 5]]


def test_report_reading_gives_the_chance_level_of_the_group() -> None:
    from tapelm.report.tasks_section import reading

    def stats(mean: float) -> dict:
        return {"mean": mean, "std": 0.0, "n": 1, "half_width": float("nan")}

    row = {
        "seeds": [0],
        "in_distribution": stats(0.9),
        "longer": stats(0.0),
        "per_seed": {"in_distribution": {0: 0.9}},
        "token_accuracy": {"in_distribution": stats(0.99), "longer": stats(0.5)},
    }
    summary = {
        "rows": {"tape": row, "rope": row},
        "metric": "exact_match",
        "task": "word_problem",
        "paired": {},
        "record": {"task_options": {"group": "A5", "num_elements": 8}},
    }
    assert any("1/|A5| = 1.7%" in sentence for sentence in reading(summary))
