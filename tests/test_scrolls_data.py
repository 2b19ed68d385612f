"""SCROLLS data from local files (JSONL and Parquet written here), prompts truncated as the paper's fine-tuning code
truncates them, and the loss mask on the target tokens only."""

from __future__ import annotations

import json

import pytest
import torch

from tapelm.data.tokenization import ByteTokenizer
from tapelm.scrolls.data import load_examples, load_rows
from tapelm.scrolls.finetune import TrainingStream
from tapelm.scrolls.models import TapeTextCodec
from tapelm.scrolls.prompting import (
    SUMMARY_INSTRUCTION,
    SUMMARY_PREFIX,
    PromptSettings,
    prompt_ids,
    training_example,
)
from tapelm.scrolls.tasks import get_task
from tapelm.training.schedule import learning_rate_lambda
from tapelm.training.settings import TrainSettings

ROWS = [
    {"id": "a", "pid": "a_0", "input": "Q1?\n\nDocument one.", "output": "first"},
    {"id": "b", "pid": "b_0", "input": "Q2?\n\nDocument two.", "output": "second"},
    {"id": "a", "pid": "a_1", "input": "Q1?\n\nDocument one.", "output": "premier"},
    {"id": "c", "pid": "c_0", "input": "Q3?\n\nDocument three.", "output": None},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_rows_and_references_grouped_by_id(tmp_path, fmt):
    if fmt == "jsonl":
        path = write_jsonl(tmp_path / "validation.jsonl", ROWS)
    else:
        import pandas as pd

        path = tmp_path / "validation.parquet"
        pd.DataFrame(ROWS).to_parquet(path)
    rows = load_rows("qasper", "validation", path)
    assert [(r.id, r.output) for r in rows] == [("a", "first"), ("b", "second"), ("a", "premier"), ("c", None)]
    examples = load_examples("qasper", "validation", path)
    assert [(e.id, e.outputs) for e in examples] == [("a", ["first", "premier"]), ("b", ["second"]), ("c", [])]
    assert examples[0].input == "Q1?\n\nDocument one."
    # a folder in the release layout, and a limit on distinct ids
    assert [e.id for e in load_examples("qasper", "validation", tmp_path, limit=2)] == ["a", "b"]


def test_bad_data_is_refused(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"id": "a", "question": "?", "output": "x"}])
    with pytest.raises(ValueError, match="lacks the field 'input'"):
        load_rows("qasper", "train", tmp_path / "train.jsonl")
    with pytest.raises(ValueError, match="has no validation.jsonl"):
        load_rows("qasper", "validation", tmp_path)
    with pytest.raises(ValueError, match="split='dev' is not allowed; choose one of: train, validation, test"):
        load_rows("qasper", "dev", tmp_path)
    (tmp_path / "rows.csv").write_text("id,input,output\n")
    with pytest.raises(ValueError, match="suffix '.csv'"):
        load_rows("qasper", "train", tmp_path / "rows.csv")


CODEC = TapeTextCodec(ByteTokenizer())


def test_summary_prompt_keeps_the_instruction_and_room_for_the_target():
    task = get_task("gov_report")
    settings = PromptSettings(context=100, target_cap=20)
    ids = prompt_ids(task, CODEC, "word " * 200, settings)
    assert len(ids) == 100 - 20 - 1  # the paper's 7,184 + 7 = 8,192 - 1,000 - 1, at this size
    text = CODEC.decode(ids)
    assert text.startswith(SUMMARY_PREFIX + "word word") and text.endswith(SUMMARY_INSTRUCTION)
    short = prompt_ids(task, CODEC, "tiny", settings)
    assert CODEC.decode(short) == SUMMARY_PREFIX + "tiny" + SUMMARY_INSTRUCTION


def test_qa_prompt_keeps_the_head_and_the_target_is_capped():
    task = get_task("narrative_qa")
    settings = PromptSettings(context=40, target_cap=8)
    ids = prompt_ids(task, CODEC, "Who? " + "x" * 100, settings)
    assert CODEC.decode(ids) == ("Who? " + "x" * 100)[:31]
    example = training_example(task, CODEC, "Who? " + "x" * 100, "a long answer here", settings)
    assert len(example.ids) == 40
    target = [i for i, t in zip(example.ids, example.targets) if t]
    assert target == list(b"a long a") + [CODEC.eos_id]  # capped at 8 tokens, then the end-of-sequence token
    assert example.targets == [False] * 31 + [True] * 9


def test_too_short_a_context_is_refused():
    with pytest.raises(ValueError, match="context=40 is too short for task 'qmsum'"):
        PromptSettings(context=40, target_cap=8).check(get_task("qmsum"), CODEC)
    PromptSettings(context=80, target_cap=8).check(get_task("qmsum"), CODEC)


def test_loss_mask_covers_only_target_tokens():
    task = get_task("qasper")
    settings = PromptSettings(context=48, target_cap=6)
    examples = [
        training_example(task, CODEC, f"Question {i}? " + "doc " * (i + 1), f"ans{i}", settings) for i in range(5)
    ]
    stream = TrainingStream(examples, CODEC.pad_id, batch_size=3, seed=0)
    batch = stream(4)
    assert batch["input_ids"].shape[0] == 3
    for row in range(3):
        scored = batch["labels"][row] != -100
        text = bytes(batch["input_ids"][row][scored][:-1].tolist()).decode()
        assert text.startswith("ans") and batch["input_ids"][row][scored][-1] == CODEC.eos_id
        assert int(scored.sum()) == len(text) + 1
        assert bool((batch["attention_mask"][row] == 0).logical_and(scored).any()) is False
    # a pure function of the index: the same micro-batch again, another one for another index
    assert torch.equal(stream(4)["input_ids"], batch["input_ids"])
    seen = {tuple(stream(i)["input_ids"][0].tolist()) for i in range(5)}
    assert len(seen) > 1


def test_polynomial_schedule_decays_linearly():
    factor = learning_rate_lambda(TrainSettings(steps=110, warmup=10, schedule="polynomial", min_lr_ratio=0.0))
    assert factor(10) == pytest.approx(1.0)
    assert factor(60) == pytest.approx(0.5)
    assert factor(110) == pytest.approx(0.0)
    floor = learning_rate_lambda(TrainSettings(steps=110, warmup=10, schedule="polynomial", min_lr_ratio=0.2))
    assert floor(60) == pytest.approx(0.6) and floor(110) == pytest.approx(0.2)
    assert [factor(s) for s in range(10, 111)] == sorted((factor(s) for s in range(10, 111)), reverse=True)
