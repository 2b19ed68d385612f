"""Laws of the seeded tasks: formats, loss masks, padding, seeding, splits, metrics and option checks."""

from __future__ import annotations

import math
import re
import string

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tapelm.data.corpora import VAL_EVERY, corpus_files
from tapelm.data.passkey_text import FILLER, TASK_LINE
from tapelm.experiments.tasks import (
    IGNORE_INDEX,
    TASKS,
    TEST_SEED,
    Batch,
    ByteTokenizer,
    Example,
    SymbolTokenizer,
    collate,
    evaluate_task,
    exact_match_per_example,
    get_task,
    target_accuracy_per_example,
)
from tapelm.experiments.tasks.addition import format_problem
from tapelm.experiments.tasks.base import HOLDOUT_EVERY, held_out
from tapelm.experiments.tasks.text import sliding_windows

SYNTHETIC = sorted(set(TASKS) - {"text"})


def _corpus_text(i: int) -> str:
    words = " ".join(f"w{(i * 7 + j) % 13}" for j in range(60))
    return f"file{i:03d}marker\n{words}\n"


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A directory of 41 small text files, each starting with a unique marker."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(41):
        (root / f"f{i:03d}.txt").write_text(_corpus_text(i))
    return str(root)


def make_task(name: str, corpus: str):
    return get_task(name, corpus=corpus, train_length=32) if name == "text" else get_task(name)


def rows(batch: Batch) -> list[tuple[list[int], list[bool]]]:
    """Each row without its padding: (ids, is_labelled)."""
    out = []
    for ids, labels, mask in zip(batch.input_ids.tolist(), batch.labels.tolist(), batch.attention_mask.tolist()):
        start = mask.index(1)
        out.append((ids[start:], [label != IGNORE_INDEX for label in labels[start:]]))
    return out


def labelled_text(tokenizer, ids: list[int], labelled: list[bool]) -> str:
    return tokenizer.decode([i for i, keep in zip(ids, labelled) if keep])


def oracle(vocab_size: int, shift: int = 0):
    """A logits_fn predicting the next input token (plus `shift`, mod vocab)."""

    def logits_fn(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        nxt = (torch.roll(input_ids, -1, dims=1) + shift) % vocab_size
        return torch.nn.functional.one_hot(nxt, vocab_size).float()

    return logits_fn


def word_problem_oracle(task, shift: int = 0):
    """A logits_fn predicting, at each element token, the running product of the elements so far (plus `shift`
    elements, cyclically), computed with permutation matrices: the oracle of the tagging task `word_problem`."""
    from test_word_problem import matrix_running_products

    def logits_fn(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        first, size = task.first_element_id, len(task.elements)
        targets = torch.zeros_like(input_ids)
        for row, ids in enumerate(input_ids.tolist()):
            positions = [t for t, i in enumerate(ids) if first <= i < first + size]
            states = matrix_running_products(task.elements, [ids[t] - first for t in positions])
            for t, state in zip(positions, states):
                targets[row, t] = first + (state + shift) % size
        return torch.nn.functional.one_hot(targets, task.tokenizer.vocab_size).float()

    return logits_fn


ORACLES = {"word_problem": word_problem_oracle}


def assert_well_formed(batch: Batch, pad_id: int, tagging: bool = False) -> None:
    """Left padding, labels only on real tokens, at least one per row; labels == ids unless the task tags."""
    ids, labels, mask = batch.input_ids, batch.labels, batch.attention_mask
    assert ids.dtype == labels.dtype == mask.dtype == torch.long
    assert ids.shape == labels.shape == mask.shape
    assert bool((mask[:, 1:] >= mask[:, :-1]).all()), "padding must be on the left"
    assert bool((mask[:, -1] == 1).all())
    assert bool((ids[mask == 0] == pad_id).all()) and bool((ids[mask == 1] != pad_id).all())
    if tagging:
        assert bool(((labels == IGNORE_INDEX) | ((labels >= 0) & (labels != pad_id))).all())
    else:
        assert bool(((labels == IGNORE_INDEX) | (labels == ids)).all())
    assert bool((labels[mask == 0] == IGNORE_INDEX).all())
    assert bool(((labels != IGNORE_INDEX).sum(dim=1) > 0).all())


# --- registry and options ---------------------------------------------------------------------------------------


def test_registry_names() -> None:
    assert sorted(TASKS) == sorted(
        [
            "addition",
            "passkey",
            "multikey",
            "mqar",
            "flipflop",
            "selective_copy",
            "counting",
            "copy",
            "text",
            "word_problem",
        ]
    )
    assert all(TASKS[name].name == name for name in TASKS)


def test_unknown_task_lists_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown task 'x'; choose one of: addition, copy, counting"):
        get_task("x")


def test_unknown_option_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown option 'digits' for task 'addition'.*max_train_digits"):
        get_task("addition", digits=3)


@pytest.mark.parametrize(
    ("name", "option", "value"),
    [
        ("addition", "max_train_digits", 0),
        ("addition", "eval_max_digits", 500),
        ("addition", "max_train_digits", 2.5),
        ("passkey", "train_length", 100),
        ("passkey", "depths", (0.5, 1.5)),
        ("passkey", "eval_multipliers", ()),
        ("multikey", "num_keys", 1),
        ("mqar", "num_keys", 16),
        ("mqar", "num_pairs", 0),
        ("mqar", "min_pairs", 9),
        ("flipflop", "p_ignore", 1.5),
        ("flipflop", "num_instructions", 1),
        ("selective_copy", "region_length", 4),
        ("selective_copy", "alphabet_size", 27),
        ("counting", "p_print", -0.1),
        ("counting", "num_variables", 11),
        ("copy", "max_length", 0),
        ("copy", "eval_multipliers", (0, 2)),
        ("text", "tokenizer", "words"),
        ("text", "stride", 32),
        ("text", "bpe_vocab_size", 100),
        ("text", "train_length", 1),
        ("word_problem", "group", "S6"),
        ("word_problem", "num_elements", 0),
        ("word_problem", "eval_multipliers", (2, 0)),
    ],
)
def test_bad_option_names_the_option(name: str, option: str, value: object, corpus: str) -> None:
    options = {"corpus": corpus, "train_length": 32, "tokenizer": "bpe"} if name == "text" else {}
    options[option] = value
    with pytest.raises(ValueError, match=f"^{option}="):
        get_task(name, **options)


# --- properties every task shares ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TASKS))
def test_train_batches_are_seeded_and_well_formed(name: str, corpus: str) -> None:
    task = make_task(name, corpus)
    first = task.train_batch(np.random.default_rng(7), 16)
    again = task.train_batch(np.random.default_rng(7), 16)
    other = task.train_batch(np.random.default_rng(8), 16)
    assert torch.equal(first.input_ids, again.input_ids) and torch.equal(first.labels, again.labels)
    assert not torch.equal(first.input_ids, other.input_ids)
    for batch in (first, other):
        assert_well_formed(batch, task.tokenizer.pad_id, task.tagging)
        assert batch.input_ids.shape[1] <= task.train_length
        assert int(batch.input_ids.max()) < task.tokenizer.vocab_size


@pytest.mark.parametrize("name", sorted(TASKS))
def test_eval_batches_depend_only_on_condition_and_seed(name: str, corpus: str) -> None:
    task = make_task(name, corpus)
    condition = task.eval_conditions()[-1]
    n = 12 if name != "text" else 16

    def examples(seed: int, batch_size: int) -> list:
        return [row for batch in task.eval_batches(condition, seed, n, batch_size) for row in rows(batch)]

    assert examples(3, 5) == examples(3, 12)
    assert examples(3, 5) != examples(4, 5)
    for batch in task.eval_batches(condition, 3, n, 5):
        assert_well_formed(batch, task.tokenizer.pad_id, task.tagging)
        assert batch.input_ids.shape[1] <= condition["length"] <= task.max_eval_length


@pytest.mark.parametrize("name", SYNTHETIC)
def test_oracle_scores_one_and_a_wrong_model_scores_less(name: str) -> None:
    task = make_task(name, "")
    make_oracle = ORACLES.get(name, lambda task, shift=0: oracle(task.tokenizer.vocab_size, shift))
    perfect = evaluate_task(task, make_oracle(task), seed=0, n_per_condition=4, batch_size=3)
    assert perfect["metric"] == task.metric_name and perfect["task"] == name
    assert perfect["mean"] == 1.0
    assert len(perfect["conditions"]) == len(task.eval_conditions())
    assert all(row["n"] == 4 and row["value"] == 1.0 for row in perfect["conditions"])
    wrong = evaluate_task(task, make_oracle(task, shift=1), seed=0, n_per_condition=4, batch_size=3)
    assert wrong["mean"] == 0.0


@pytest.mark.parametrize("name", sorted(TASKS))
def test_tokenizer_round_trips_generated_text(name: str, corpus: str) -> None:
    task = make_task(name, corpus)
    for ids, _ in rows(task.train_batch(np.random.default_rng(0), 8)):
        assert task.tokenizer.encode(task.tokenizer.decode(ids)) == ids


# --- collation, tokenizers and metrics -------------------------------------------------------------------------


@given(st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=12), min_size=1, max_size=6), st.data())
def test_collate_left_pads(sequences: list[list[int]], data: st.DataObject) -> None:
    masks = [data.draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids))) for ids in sequences]
    examples = [Example(ids, targets) for ids, targets in zip(sequences, masks)]
    batch = collate(examples, pad_id=0)
    width = max(map(len, sequences))
    assert batch.input_ids.shape == (len(sequences), width)
    for row, (ids, targets, _) in enumerate(examples):
        pad = width - len(ids)
        assert batch.input_ids[row].tolist() == [0] * pad + ids
        assert batch.attention_mask[row].tolist() == [0] * pad + [1] * len(ids)
        expected = [i if t else IGNORE_INDEX for i, t in zip(ids, targets)]
        assert batch.labels[row].tolist() == [IGNORE_INDEX] * pad + expected


def test_symbol_tokenizer_takes_longest_symbols() -> None:
    tokenizer = SymbolTokenizer(["k1", "k12", "v2", "2"])
    ids = tokenizer.encode("<bos>k12v2k12")
    assert [tokenizer.symbols[i] for i in ids] == ["<bos>", "k12", "v2", "k12"]
    assert tokenizer.decode([tokenizer.pad_id, *ids]) == "<bos>k12v2k12"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.encode("k1x")


@given(st.text(max_size=50))
def test_byte_tokenizer_round_trips(text: str) -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert all(0 <= i < 256 for i in ids) and tokenizer.pad_id == 256 and tokenizer.vocab_size == 257
    assert tokenizer.decode([*ids, tokenizer.pad_id]) == text


def _constructed_batch() -> Batch:
    return collate([Example([1, 5, 6, 7], [False, False, True, True]), Example([1, 8, 9], [False, True, True])], 0)


def test_exact_match_needs_every_target_token() -> None:
    batch = _constructed_batch()
    logits = oracle(10)(batch.input_ids, batch.attention_mask)
    assert exact_match_per_example(logits, batch).tolist() == [True, True]
    logits[0, 0] = torch.nn.functional.one_hot(torch.tensor(0), 10)  # wrong at a non-target ("5"): still right
    assert exact_match_per_example(logits, batch).tolist() == [True, True]
    logits[0, 2] = torch.nn.functional.one_hot(torch.tensor(0), 10)  # wrong at the target "7"
    assert exact_match_per_example(logits, batch).tolist() == [False, True]
    assert target_accuracy_per_example(logits, batch).tolist() == [0.5, 1.0]


# --- addition ---------------------------------------------------------------------------------------------------

ADDITION = re.compile(r"<bos>(\d+)\+(\d+)=(\d+)<eos>")


@given(st.integers(0, 10**30), st.integers(0, 10**30))
def test_addition_format_reverses_every_number(a: int, b: int) -> None:
    prompt, answer = format_problem(str(a), str(b))
    match = ADDITION.fullmatch(prompt + answer)
    assert match is not None
    assert [int(group[::-1]) for group in match.groups()] == [a, b, a + b]
    assert answer == str(a + b)[::-1] + "<eos>"


def test_addition_examples_are_correct_sums_with_answer_only_loss() -> None:
    task = get_task("addition", max_train_digits=3)
    buckets = set()
    for ids, labelled in rows(task.train_batch(np.random.default_rng(0), 600)):
        text = task.tokenizer.decode(ids)
        a, b, c = (g[::-1] for g in ADDITION.fullmatch(text).groups())
        assert int(a) + int(b) == int(c) and str(int(c)) == c
        assert all(len(x) == 1 or x[0] != "0" for x in (a, b))
        buckets.add((len(a), len(b)))
        answer_start = text.index("=") - len("<bos>") + 2  # "<bos>" is one token
        assert labelled == [i >= answer_start for i in range(len(ids))]
        assert labelled_text(task.tokenizer, ids, labelled) == c[::-1] + "<eos>"
    assert buckets == {(x, y) for x in range(1, 4) for y in range(1, 4)}


def test_addition_eval_grid_and_cells() -> None:
    task = get_task("addition", max_train_digits=2, eval_max_digits=5)
    conditions = task.eval_conditions()
    assert [(c["len_a"], c["len_b"]) for c in conditions] == [(x, y) for x in range(1, 6) for y in range(1, 6)]
    assert task.max_eval_length == 5 * 3 + 5
    for condition in conditions[::6]:
        for batch in task.eval_batches(condition, 0, 20, 20):
            for ids, _ in rows(batch):
                a, b, _ = ADDITION.fullmatch(task.tokenizer.decode(ids)).groups()
                assert (len(a), len(b)) == (condition["len_a"], condition["len_b"])


def test_addition_train_and_eval_problems_are_disjoint() -> None:
    task = get_task("addition", max_train_digits=2)

    def problems(batches) -> set[str]:
        return {task.tokenizer.decode(ids).split("=")[0] for b in batches for ids, _ in rows(b)}

    train = problems(task.train_batch(np.random.default_rng(s), 500) for s in range(8))
    cells = [c for c in task.eval_conditions() if max(c["len_a"], c["len_b"]) <= 2]
    evaluation = problems(b for c in cells for b in task.eval_batches(c, 0, 300, 300))
    assert len(train) > 1500 and len(evaluation) > 100  # both streams cover much of the 10,000 problems
    assert not train & evaluation


HINTED_NUMBER = r"((?:<\d+>\d)+)"
HINTED = re.compile(rf"<bos>{HINTED_NUMBER}\+{HINTED_NUMBER}={HINTED_NUMBER}<eos>")


def parse_hinted(number: str) -> tuple[list[int], str]:
    """(markers, reversed digits) of one hinted number."""
    pairs = re.findall(r"<(\d+)>(\d)", number)
    return [int(m) for m, _ in pairs], "".join(d for _, d in pairs)


@pytest.mark.parametrize("split", ["train", "eval"])
def test_index_hints_mark_each_digit_by_significance_in_operands_and_answer(split: str) -> None:
    task = get_task("addition", max_train_digits=3, eval_max_digits=6, format="index_hints")
    assert task.hint_symbols == 14  # twice the longest answer's digits
    if split == "train":
        batches = [task.train_batch(np.random.default_rng(0), 800)]
    else:
        batches = [b for c in task.eval_conditions()[::5] for b in task.eval_batches(c, 0, 30, 30)]
    seen = set()
    for batch in batches:
        for ids, labelled in rows(batch):
            text = task.tokenizer.decode(ids)
            a, b, c = (parse_hinted(g) for g in HINTED.fullmatch(text).groups())
            assert int(a[1][::-1]) + int(b[1][::-1]) == int(c[1][::-1])
            first = a[0][0]
            for markers, digits in (a, b, c):  # consecutive markers from the same first one: equal significance
                assert markers == list(range(first, first + len(digits)))
            assert max(c[0]) < task.hint_symbols
            seen.update(c[0])
            answer = text[text.index("=") + 1 :]
            assert labelled_text(task.tokenizer, ids, labelled) == answer
    if split == "train":  # short operands still show every marker
        assert seen == set(range(task.hint_symbols))


def test_index_hints_keep_the_plain_problems_and_lengths() -> None:
    plain = get_task("addition", max_train_digits=3, eval_max_digits=6)
    hinted = get_task("addition", max_train_digits=3, eval_max_digits=6, format="index_hints")
    condition = {"len_a": 5, "len_b": 2, "length": 0}
    for seed in range(5):
        digits = re.sub(
            r"<\d+>", "", hinted.tokenizer.decode(hinted.eval_example(np.random.default_rng(seed), condition).ids)
        )
        assert digits == plain.tokenizer.decode(plain.eval_example(np.random.default_rng(seed), condition).ids)
    assert hinted.train_length == 4 + 2 * (3 + 3 + 4)
    assert max(c["length"] for c in hinted.eval_conditions()) == hinted.max_eval_length == 4 + 2 * (6 + 6 + 7)


def test_index_hint_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"format='hints' is not allowed; it must be one of: plain, index_hints"):
        get_task("addition", format="hints")
    with pytest.raises(ValueError, match=r"hint_symbols=5 is not allowed; it must be an integer in \[7, 1000\]"):
        get_task("addition", max_train_digits=3, eval_max_digits=6, format="index_hints", hint_symbols=5)
    with pytest.raises(ValueError, match=r"hint_symbols=20 is not allowed with format='plain'"):
        get_task("addition", hint_symbols=20)


def test_holdout_share_and_smallest_cell() -> None:
    keys = [str(k) for k in range(1, 50000)]
    share = sum(map(held_out, keys)) / len(keys)
    assert abs(share - 1 / HOLDOUT_EVERY) < 0.01
    assert any(held_out(f"{a}+{b}") for a in range(10) for b in range(10))  # the 1x1 cell can be evaluated


# --- passkey and multikey ---------------------------------------------------------------------------------------

NEEDLE = re.compile(r"The pass key is (\d+)\. Remember it\. \1 is the pass key\.")


def test_passkey_documents_follow_the_paper_wording() -> None:
    task = get_task("passkey", train_length=400)
    for condition in task.eval_conditions():
        for ids, labelled in rows(next(task.eval_batches(condition, 1, 4, 4))):
            text = task.tokenizer.decode(ids)
            key = NEEDLE.search(text).group(1)
            assert 1 <= int(key) < 50000
            assert text.startswith(TASK_LINE + " ")
            assert text.endswith(f"What is the pass key? The pass key is {key}.")
            assert labelled_text(task.tokenizer, ids, labelled) == f" {key}."
            assert labelled == [i >= len(ids) - len(key) - 2 for i in range(len(ids))]
            assert condition["length"] - max(map(len, FILLER)) - 1 < len(ids) <= condition["length"]
            filler = text[len(TASK_LINE) + 1 : text.index(" What is")]
            sentences = re.findall(r"[^.]+\.", filler)
            before = re.findall(r"[^.]+\.", filler[: NEEDLE.search(filler).start()])
            assert round(condition["depth"] * (len(sentences) - 3)) == len(before)
            assert set(s.strip() for s in sentences) - set(FILLER) <= {
                f"The pass key is {key}.",
                "Remember it.",
                f"{key} is the pass key.",
            }


def test_passkey_train_and_eval_keys_are_disjoint() -> None:
    task = get_task("passkey", train_length=300)

    def keys(batches) -> set[str]:
        return {NEEDLE.search(task.tokenizer.decode(ids)).group(1) for b in batches for ids, _ in rows(b)}

    train = keys(task.train_batch(np.random.default_rng(s), 250) for s in range(6))
    evaluation = keys(b for c in task.eval_conditions()[:5] for b in task.eval_batches(c, 0, 150, 150))
    assert len(train) > 1000 and len(evaluation) > 400
    assert not train & evaluation


def test_multikey_asks_for_one_of_several_labelled_keys() -> None:
    task = get_task("multikey", num_keys=3)
    asked = set()
    for ids, labelled in rows(task.train_batch(np.random.default_rng(0), 30)):
        text = task.tokenizer.decode(ids)
        lines = dict(re.findall(r"The pass key for (\w+) is (\d+)\. Remember it\. \d+ is the pass key for \w+\.", text))
        assert sorted(lines) == ["blue", "green", "red"] and len(set(lines.values())) == 3
        label = re.search(r"What is the pass key for (\w+)\? The pass key for \1 is \d+\.$", text).group(1)
        assert labelled_text(task.tokenizer, ids, labelled) == f" {lines[label]}."
        asked.add(label)
    assert asked == {"blue", "green", "red"}


# --- mqar, flip-flop, selective copy, copy, counting ------------------------------------------------------------


@pytest.mark.parametrize("min_pairs", [1, 4])
def test_mqar_queries_recall_their_values(min_pairs: int) -> None:
    task = get_task("mqar", num_pairs=6, min_pairs=min_pairs)
    counts = set()
    for ids, labelled in rows(task.train_batch(np.random.default_rng(0), 50)):
        symbols = [task.tokenizer.symbols[i] for i in ids]
        pairs = len(symbols[1:]) // 4
        context = dict(zip(symbols[1 : 2 * pairs + 1 : 2], symbols[2 : 2 * pairs + 1 : 2]))
        queries = symbols[2 * pairs + 1 :]
        assert symbols[0] == "<bos>" and len(context) == pairs and min_pairs <= pairs <= 6
        counts.add(pairs)
        assert all(k.startswith("k") and v.startswith("v") for k, v in context.items())
        assert sorted(queries[::2]) == sorted(context)
        assert all(context[k] == v for k, v in zip(queries[::2], queries[1::2]))
        assert labelled == [i > 2 * pairs and i % 2 == 0 for i in range(len(ids))]
    assert counts == set(range(min_pairs, 7))


def test_flipflop_reads_return_the_last_write() -> None:
    task = get_task("flipflop", num_instructions=40)
    for condition in task.eval_conditions():
        ignores = instructions = 0
        for ids, labelled in rows(next(task.eval_batches(condition, 0, 60, 60))):
            text = task.tokenizer.decode(ids)
            assert text.startswith("<bos>w") and text[-2] == "r" and len(ids) == condition["length"]
            pairs = re.findall(r"([wri])([01])", text[len("<bos>") :])
            memory = None
            for instruction, bit in pairs:
                if instruction == "r":
                    assert bit == memory
                memory = bit if instruction == "w" else memory
            body = text[len("<bos>") :]
            assert labelled == [i > 0 and i % 2 == 0 and body[i - 2] == "r" for i in range(len(ids))]
            ignores += sum(i == "i" for i, _ in pairs[1:-1])
            instructions += len(pairs) - 2
        assert abs(ignores / instructions - condition["p_ignore"]) < 0.05


def test_in_distribution_means_what_training_draws() -> None:
    flipflop = get_task("flipflop", num_instructions=40)
    inside = [c for c in flipflop.eval_conditions() if flipflop.in_distribution(c)]
    assert inside == [{"split": "in_distribution", "p_ignore": 0.8, "num_instructions": 40, "length": 81}]
    addition = get_task("addition", max_train_digits=3, eval_max_digits=5)
    assert sorted((c["len_a"], c["len_b"]) for c in addition.eval_conditions() if addition.in_distribution(c)) == [
        (a, b) for a in range(1, 4) for b in range(1, 4)
    ]
    mqar = get_task("mqar", num_pairs=4, eval_multipliers=(1, 2))
    assert [mqar.in_distribution(c) for c in mqar.eval_conditions()] == [True, False]


def test_selective_copy_outputs_the_data_tokens_in_order() -> None:
    task = get_task("selective_copy", num_tokens=5, region_length=20)
    for ids, labelled in rows(task.train_batch(np.random.default_rng(0), 50)):
        text = task.tokenizer.decode(ids)
        region, output = text[len("<bos>") :].split("|")
        assert 5 <= len(region) <= 20 and set(region) <= set(string.ascii_lowercase[:16]) | {"."}
        assert output == region.replace(".", "") + "<eos>"
        assert labelled_text(task.tokenizer, ids, labelled) == output
        assert labelled == [i > len(region) + 1 for i in range(len(ids))]


def test_copy_outputs_the_input() -> None:
    task = get_task("copy", max_length=10, alphabet_size=4)
    lengths = set()
    for ids, labelled in rows(task.train_batch(np.random.default_rng(0), 100)):
        source, output = task.tokenizer.decode(ids)[len("<bos>") :].split("|")
        assert output == source + "<eos>" and set(source) <= set("abcd")
        assert labelled == [i > len(source) + 1 for i in range(len(ids))]
        lengths.add(len(source))
    assert lengths == set(range(1, 11))


def test_counting_prints_the_running_count() -> None:
    task = get_task("counting", num_statements=20, num_variables=3)
    for ids, labelled in rows(task.train_batch(np.random.default_rng(0), 50)):
        symbols = [task.tokenizer.symbols[i] for i in ids]
        assert symbols[0] == "<bos>" and "".join(symbols).endswith(";")
        counts = {v: 0 for v in "abc"}
        expected = [False]
        i = 1
        while i < len(symbols):
            if symbols[i] == "print ":
                value = str(counts[symbols[i + 1]])
                assert "".join(symbols[i + 3 : i + 4 + len(value)]) == value + ";"
                expected += [False] * 3 + [True] * (len(value) + 1)
                i += 4 + len(value)
            else:
                assert symbols[i + 1 : i + 3] == ["++", ";"]
                counts[symbols[i]] += 1
                expected += [False] * 3
                i += 3
        assert labelled == expected


# --- text -------------------------------------------------------------------------------------------------------


def test_text_split_holds_out_whole_files(corpus: str) -> None:
    task = get_task("text", corpus=corpus, train_length=32)
    train, validation = (task.tokenizer.decode(s.tolist()) for s in (task.train_stream, task.validation_stream))
    for i in range(41):
        marker = f"file{i:03d}marker"
        assert (marker in validation) == (i % VAL_EVERY == 0) != (marker in train)
    assert validation == "".join(_corpus_text(i) for i in range(0, 41, VAL_EVERY))


def test_text_corpus_list_is_split_source_by_source(corpus: str, tmp_path) -> None:
    """A list of sources holds out each source's own every-20th file, as each source alone does: a file held out in
    one corpus is never trained on in another that contains its source."""
    other = tmp_path / "other"
    other.mkdir()
    for i in range(25):
        (other / f"g{i:03d}.txt").write_text(_corpus_text(100 + i))
    task = get_task("text", corpus=[corpus, str(other)], train_length=32)
    train, validation = (task.tokenizer.decode(s.tolist()) for s in (task.train_stream, task.validation_stream))
    alone = get_task("text", corpus=str(other), train_length=32)
    assert validation == get_task("text", corpus=corpus, train_length=32).tokenizer.decode(
        get_task("text", corpus=corpus, train_length=32).validation_stream.tolist()
    ) + alone.tokenizer.decode(alone.validation_stream.tolist())
    for i in (*range(41), *range(100, 125)):
        marker = f"file{i:03d}marker"
        assert (marker in validation) == ((i % 100) % VAL_EVERY == 0) != (marker in train)
    for bad in ([], [corpus, 3]):
        with pytest.raises(ValueError, match="corpus=.* is not allowed"):
            get_task("text", corpus=bad)


def test_text_corpus_paths(corpus: str, tmp_path) -> None:
    assert len(corpus_files(corpus + "/f00*.txt")) == 10
    with pytest.raises(ValueError, match="corpus path '/no/such/place' does not exist"):
        get_task("text", corpus="/no/such/place")
    one = tmp_path / "one.txt"
    one.write_text("x" * 2000)
    task = get_task("text", corpus=str(one), train_length=16)
    assert (len(task.train_stream), len(task.validation_stream)) == (1900, 100)
    with pytest.raises(ValueError, match="too small"):
        get_task("text", corpus=str(one), train_length=4000)


def test_text_default_corpus_is_the_standard_library() -> None:
    files = corpus_files(None)
    assert len(files) > 100 and list(files) == sorted(files)
    assert all(f.suffix == ".py" and "site-packages" not in f.parts and "test" not in f.parts for f in files)
    task = get_task("text")
    assert task.tokenizer.vocab_size == 257 and len(task.validation_stream) > 10_000


def test_text_bpe_is_trained_once_and_round_trips(corpus: str) -> None:
    options = {"corpus": corpus, "train_length": 32, "tokenizer": "bpe", "bpe_vocab_size": 300}
    task = get_task("text", **options)
    assert task.tokenizer.vocab_size == 300 and task.tokenizer.pad_id == 0
    assert get_task("text", **options).tokenizer is task.tokenizer
    assert task.tokenizer.decode(task.validation_stream.tolist()) == "".join(_corpus_text(i) for i in (0, 20, 40))
    assert len(task.train_stream) < len(task.tokenizer.decode(task.train_stream.tolist()))  # merges happened


@settings(max_examples=200)
@given(st.integers(1, 400), st.integers(2, 64), st.data())
def test_sliding_windows_score_each_token_once(total: int, length: int, data: st.DataObject) -> None:
    stride = data.draw(st.integers(1, length - 1))
    windows = sliding_windows(total, length, stride)
    scored = [t for _, end, first in windows for t in range(first, end)]
    assert scored == list(range(1, total))
    for begin, end, first in windows:
        assert end - begin == min(length, total) and begin < first <= end
        assert first == 1 or first - begin >= length - stride


def test_text_eval_windows_cover_the_span_once(corpus: str) -> None:
    task = get_task("text", corpus=corpus, train_length=16, stride=5)
    condition = task.eval_conditions()[1]
    batches = list(task.eval_batches(condition, 0, 10, 4))
    labelled = [i for b in batches for ids, keep in rows(b) for i, k in zip(ids, keep) if k]
    first = batches[0].input_ids[0, 0].item()
    span = [first, *labelled]
    assert len(span) == 160 and all(b.input_ids.shape[1] == condition["length"] for b in batches)
    stream = task.validation_stream.tolist()
    assert any(stream[s : s + 160] == span for s in range(len(stream)))
    with pytest.raises(ValueError, match=r"^n=1 gives 16 held-out tokens, fewer than the eval length 32"):
        next(task.eval_batches(condition, 0, 1, 4))


def test_uniform_model_has_perplexity_vocab_size(corpus: str) -> None:
    task = get_task("text", corpus=corpus, train_length=16)
    vocab = task.tokenizer.vocab_size

    def uniform(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*input_ids.shape, vocab)

    result = evaluate_task(task, uniform, seed=1, n_per_condition=12, batch_size=5)
    assert result["metric"] == "perplexity"
    for row in result["conditions"]:
        assert math.isclose(row["value"], vocab, rel_tol=1e-4) and row["n"] == 12 * 16 - 1
    assert math.isclose(result["mean"], vocab, rel_tol=1e-4)
    sharp = evaluate_task(task, oracle(vocab), seed=1, n_per_condition=12, batch_size=5)
    assert all(math.isclose(row["value"], (math.e + vocab - 1) / math.e, rel_tol=1e-4) for row in sharp["conditions"])


EVALUATION_ALTERNATIVES = {"eval_multipliers": (1, 3), "eval_max_digits": 12, "depths": (0.25, 0.75), "stride": 8}
"""A value for each task's evaluation-only option other than its default in `make_task`."""


def _training_draws(task) -> list[tuple]:
    """What a training run reads from its task: a few batches of two seeds, the tokenizer, the data record."""
    batches = [task.train_batch(np.random.default_rng([seed, index]), 3) for seed in (0, 1) for index in range(3)]
    tokens = [(b.input_ids.tolist(), b.labels.tolist(), b.attention_mask.tolist()) for b in batches]
    return [*tokens, task.tokenizer.to_transformers().backend_tokenizer.to_str(), task.data_record()]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_evaluation_options_leave_the_training_unchanged(name, corpus):
    """A task's `evaluation_options` change its evaluation, never its training stream, tokenizer or data record:
    runs that differ only in them share one training (`runs.training_identity`)."""
    task = make_task(name, corpus)
    assert set(task.evaluation_options) <= set(EVALUATION_ALTERNATIVES), "give a new evaluation option a test value"
    base = {"corpus": corpus, "train_length": 32} if name == "text" else {}
    for option in task.evaluation_options:
        other = get_task(name, **base, **{option: EVALUATION_ALTERNATIVES[option]})
        assert other.eval_conditions() != task.eval_conditions() or option == "stride"
        assert _training_draws(other) == _training_draws(task), option


def test_a_training_option_declared_for_evaluation_would_be_caught():
    """The law above can fail: MQAR's number of pairs shapes its training stream."""
    assert _training_draws(get_task("mqar", num_pairs=4)) != _training_draws(get_task("mqar"))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 80))
@example(seed=1, n=80)  # the whole held-out stream: no room apart
@example(seed=1, n=2)
def test_text_spans_of_other_seeds_share_no_token_with_the_test_span(text_task, seed, n):
    """Any seed but the test set's scores held-out tokens apart from the test set's span of the same n wherever the
    stream has room (the validation set tuning reads; `validation_apart` says whether it has); the test set's seed
    gives the span it always gave."""
    stream = text_task.validation_stream
    size = min(n * text_task.train_length, len(stream))
    test = int(np.random.default_rng(TEST_SEED).integers(0, len(stream) - size + 1))
    assert np.array_equal(text_task._eval_span(TEST_SEED, n), stream[test : test + size])
    if seed == TEST_SEED:
        return
    apart = [o for o in range(len(stream) - size + 1) if o + size <= test or o >= test + size]
    assert text_task.validation_apart(n) == bool(apart)
    if apart:
        span = text_task._eval_span(seed, n)
        assert any(np.array_equal(stream[o : o + size], span) for o in apart)


@pytest.fixture(scope="module")
def text_task(tmp_path_factory):
    root = tmp_path_factory.mktemp("text-corpus")
    for i in range(41):
        (root / f"f{i:03d}.txt").write_text(_corpus_text(i))
    return get_task("text", corpus=str(root), train_length=8)
