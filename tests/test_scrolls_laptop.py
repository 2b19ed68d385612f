"""The laptop run's toy data (built from real standard-library sources): SCROLLS release format, the QA answer a
span of its input, the summary's reference absent from its input, validation only from held-out files."""

from __future__ import annotations

import json
from pathlib import Path

from tapelm.data.corpora import VAL_EVERY, corpus_files
from tapelm.scrolls.data import load_examples
from tapelm.scrolls.laptop import CAPS, QA_TASK, QUESTION, SUMMARY_TASK, LaptopPlan, _candidates, build_data


def test_toy_data_from_the_standard_library(tmp_path):
    every = list(corpus_files(None))
    # 60 consecutive files whose held-out ones (every 20th) hold at least 5 functions with a short docstring line
    start = next(i for i in range(0, len(every) - 60, 20) if len(_candidates(every[i : i + 60 : VAL_EVERY])) >= 5)
    files = every[start : start + 60]
    plan = LaptopPlan(train_examples=30, validation_examples=5)
    record = build_data(tmp_path, plan, pretrained_length=64, files=files)
    assert record["context"] == 256
    held_out = {f"{p.parent.name}/{p.name}" for p in files[::VAL_EVERY]}
    for task in (QA_TASK, SUMMARY_TASK):
        for split, count in (("train", 30), ("validation", 5)):
            rows = [json.loads(line) for line in (tmp_path / task / f"{split}.jsonl").read_text().splitlines()]
            assert len(rows) == count and len({r["id"] for r in rows}) == count
            assert all(set(r) == {"id", "pid", "input", "output"} for r in rows)
            assert all((r["id"].split(":")[0] in held_out) == (split == "validation") for r in rows)
            for row in rows:
                assert 10 <= len(row["output"]) <= CAPS[task]
                if task == QA_TASK:
                    name = row["id"].split(":")[1]
                    assert row["input"].startswith(QUESTION.format(name=name))
                    assert row["output"] in row["input"][len(QUESTION.format(name=name)) :]  # a span of the document
                    assert len(row["input"]) <= record["context"] - CAPS[task] - 1  # fits with room for the answer
                else:
                    assert (
                        row["input"].lstrip().startswith(("def ", "async def "))
                        and '"""' + row["output"] not in row["input"]
                        and "'''" + row["output"] not in row["input"]
                    )
        examples = load_examples(task, "validation", tmp_path / task)
        assert len(examples) == 5 and all(len(e.outputs) == 1 for e in examples)
    # unchanged request: the files are kept, not rebuilt
    stamp = (tmp_path / QA_TASK / "train.jsonl").stat().st_mtime_ns
    build_data(tmp_path, plan, pretrained_length=64, files=files)
    assert (tmp_path / QA_TASK / "train.jsonl").stat().st_mtime_ns == stamp
    assert Path(tmp_path / "description.json").is_file()
