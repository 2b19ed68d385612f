"""SCROLLS data, read with the `datasets` library: from the Hugging Face Hub (`tau/scrolls`, config = task) when the
machine is online, or from local files in the SCROLLS release format.

The release format: one JSON object per row with the fields `id` (the example), `pid` (the row), `input` (for QA and
NLI the question and the document as released; for summaries the document) and `output` (one reference; empty or
null in the test split). In the validation split an example with several references has several rows with the same
`id`. Local data is a `.jsonl` / `.json` / `.parquet` file, or a folder holding `{split}.jsonl` or
`{split}.parquet` (the official per-task zip files unpack to `train.jsonl`, `validation.jsonl`, `test.jsonl`).

The Hub path is not exercised here (no network): `tau/scrolls` is a script-based repository, which recent
`datasets` versions refuse to run, so on failure the Hub's own Parquet conversion (revision "refs/convert/parquet")
is tried; if both fail, the error says to download the release zip and pass its folder.

`load_rows` gives every row (what fine-tuning trains on: one example per row with a non-empty output);
`load_examples` groups rows by id, keeping the first row's input and every non-empty output as the references (what
prediction and scoring use).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

HUB_DATASET = "tau/scrolls"
SPLITS = ("train", "validation", "test")
FIELDS = ("id", "input", "output")
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class Row:
    id: str
    input: str
    output: str | None


@dataclass
class Example:
    """One SCROLLS example: its input and every reference of its id (none in a test split)."""

    id: str
    input: str
    outputs: list[str] = field(default_factory=list)


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not allowed; choose one of: {', '.join(SPLITS)}")
    return split


def resolve_file(data: str | Path, split: str) -> Path:
    """The local file holding `split` of `data` (a file, or a folder with {split}.jsonl / {split}.parquet)."""
    check_split(split)
    path = Path(data).expanduser()
    if path.is_dir():
        for suffix in (".jsonl", ".parquet", ".json"):
            if (path / f"{split}{suffix}").is_file():
                return path / f"{split}{suffix}"
        raise ValueError(
            f"data folder '{path}' has no {split}.jsonl or {split}.parquet; pass a file or a folder "
            "in the SCROLLS release layout"
        )
    if not path.is_file():
        raise ValueError(
            f"data path '{path}' does not exist; pass a .jsonl, .json or .parquet file, a folder with "
            f"{split}.jsonl, or 'hub' to download {HUB_DATASET}"
        )
    if path.suffix not in FORMATS:
        raise ValueError(f"data file '{path}' has suffix {path.suffix!r}; allowed: {', '.join(FORMATS)}")
    return path


def _load_dataset(task: str, split: str, data: str | Path | None):
    import datasets

    if data is None or str(data) == "hub":
        try:
            return datasets.load_dataset(HUB_DATASET, task, split=split)
        except Exception as error:  # datasets raises many kinds (offline, script-based repository, ...)
            try:  # the Hub's own Parquet conversion of the script-based repository
                return datasets.load_dataset(HUB_DATASET, task, split=split, revision="refs/convert/parquet")
            except Exception:
                raise ValueError(
                    f"could not load {HUB_DATASET} '{task}' split '{split}' from the Hub "
                    f"({type(error).__name__}: {str(error).splitlines()[0][:200]}); download the "
                    "task's release zip and pass its folder with --data"
                ) from None
    path = resolve_file(data, split)
    logging_was = datasets.utils.logging.get_verbosity()
    bars_were_off = datasets.utils.are_progress_bars_disabled()
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)  # a bad file is reported below, once
    datasets.utils.disable_progress_bars()  # a bar per small local file is noise
    try:
        return datasets.load_dataset(FORMATS[path.suffix], data_files=str(path), split="train")
    except Exception as error:  # datasets wraps the parser's error in its own kinds
        raise ValueError(_unreadable(path, error)) from None
    finally:
        datasets.utils.logging.set_verbosity(logging_was)
        if not bars_were_off:
            datasets.utils.enable_progress_bars()


def _unreadable(path: Path, error: Exception) -> str:
    """Why a local data file does not load: the first malformed line of a .jsonl, else the loader's reason."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8", errors="replace") as lines:
            for number, line in enumerate(lines, 1):
                try:
                    if line.strip():
                        json.loads(line)
                except json.JSONDecodeError as bad:
                    return (
                        f"data file '{path}' line {number} is not valid JSON ({bad.msg}); each line must be one "
                        "JSON object with id, input and output"
                    )
    reason = (str(error).strip().splitlines() or [""])[0][:200]
    return f"data file '{path}' cannot be read as {path.suffix[1:]} ({type(error).__name__}: {reason})"


def load_rows(task: str, split: str, data: str | Path | None = None, limit: int | None = None) -> list[Row]:
    """Every row of one split, in file order (at most `limit` distinct ids when given). `data`: a local path, or
    None / "hub" for the Hub. ValueError naming a missing field."""
    check_split(split)
    table = _load_dataset(task, split, data)
    missing = [name for name in FIELDS if name not in table.column_names]
    if missing:
        raise ValueError(
            f"SCROLLS data for '{task}' ({split}) lacks the field '{missing[0]}'; each row needs "
            f"{', '.join(FIELDS)} (and usually pid); it has: {', '.join(table.column_names)}"
        )
    rows, seen = [], set()
    for record in table.select_columns(list(FIELDS)):
        key = str(record["id"])
        if limit is not None and key not in seen and len(seen) >= limit:
            break
        seen.add(key)
        if not isinstance(record["input"], str):
            raise ValueError(f"row with id {key!r} has input={record['input']!r}; the field 'input' must be text")
        output = record["output"]
        rows.append(Row(key, record["input"], output if isinstance(output, str) else None))
    if not rows:
        raise ValueError(f"SCROLLS data for '{task}' ({split}) has no rows")
    return rows


def group_rows(rows: list[Row]) -> list[Example]:
    """Rows grouped by id in order of first appearance: the first row's input, every non-empty output."""
    examples: dict[str, Example] = {}
    for row in rows:
        example = examples.setdefault(row.id, Example(row.id, row.input))
        if row.output:
            example.outputs.append(row.output)
    return list(examples.values())


def load_examples(task: str, split: str, data: str | Path | None = None, limit: int | None = None) -> list[Example]:
    """The split's examples, references grouped by id (see the module docstring)."""
    return group_rows(load_rows(task, split, data, limit))


def references(examples: list[Example]) -> dict[str, list[str]]:
    """id -> references, for `tapelm.scrolls.score`."""
    return {example.id: list(example.outputs) for example in examples}


__all__ = [
    "HUB_DATASET",
    "SPLITS",
    "Row",
    "Example",
    "load_rows",
    "load_examples",
    "group_rows",
    "references",
    "resolve_file",
    "check_split",
]
