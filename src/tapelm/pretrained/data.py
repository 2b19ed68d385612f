"""Real text for retrofitting a pretrained model, tokenized with the model's own tokenizer.

Two corpora, both split by file exactly as the `text` task splits them (sorted files; file i is held out when
i % VAL_EVERY == 0), so no held-out file is ever trained on:

- "code": the Python standard library's *.py files (the source "stdlib" of `tapelm.experiments.tasks.corpora`).
- "prose": the Python 3.11 documentation (the source "python-docs", fetched once with apt-get), or any file tree
  given as `prose` (`tapelm finetune --prose-corpus`), e.g. on a machine without apt-get.

Training: a stream per corpus of whole training files in a seeded shuffled order, separated by the tokenizer's eos,
cut after `train_tokens` tokens; a micro-batch is a window of `length` tokens from one corpus (alternating), at a
position drawn from the batch index, so batches are a pure function of the index (resumable, identical for every
method). Evaluation: whole held-out files that are long enough, each tokenized on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..data.corpora import PYTHON_DOCS, STDLIB, VAL_EVERY, corpus_files, python_docs, split_files

CORPORA = ("code", "prose")
PROSE_OPTION = "--prose-corpus"


def corpus_split(name: str, prose: str | None = None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of a corpus, split like the `text` task. `prose`: a file tree (or glob) to
    use as the prose corpus instead of python3.11-doc."""
    files = list(corpus_files(source_of(name, prose)))
    if len(files) < 2:
        raise ValueError(
            f"the {name} corpus has {len(files)} file; it needs at least 2 (file i is held out when "
            f"i % {VAL_EVERY} == 0, the others are trained on)"
        )
    return split_files(files)


def source_of(name: str, prose: str | None = None) -> str:
    """The `tapelm.experiments.tasks.corpora` source of corpus `name`: "stdlib" for code, "python-docs" or `prose`
    for prose; ValueError naming PROSE_OPTION when the prose corpus is not there and cannot be fetched."""
    if name == "code":
        return STDLIB
    if name != "prose":
        raise ValueError(f"corpus={name!r} is not allowed; choose one of: {', '.join(CORPORA)}")
    if prose is not None:
        if not any(char in prose for char in "*?[") and not Path(prose).exists():
            raise ValueError(f"{PROSE_OPTION} '{prose}' does not exist; give a folder of text files or a glob")
        return prose
    try:
        python_docs()
    except ValueError as error:
        raise ValueError(f"{error} ({PROSE_OPTION} FOLDER)") from None
    return PYTHON_DOCS


def _read(path: Path) -> str | None:
    try:
        return path.read_text("utf-8")
    except UnicodeDecodeError:
        return None


def training_stream(tokenizer, name: str, train_tokens: int, seed: int = 0, prose: str | None = None) -> np.ndarray:
    """At least `train_tokens` tokens (fewer if the corpus is smaller) of whole training files, eos-separated."""
    files, _ = corpus_split(name, prose)
    order = np.random.default_rng(seed).permutation(len(files))
    pieces, total = [], 0
    for index in order:
        text = _read(files[index])
        if not text:
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        pieces.append(np.asarray(ids, dtype=np.int64))
        total += len(ids)
        if total >= train_tokens:
            break
    if not pieces:
        raise ValueError(f"the {name} corpus has no readable text in its training files")
    return np.concatenate(pieces)


def held_out_documents(
    tokenizer, name: str, min_tokens: int, count: int, prose: str | None = None
) -> list[tuple[str, np.ndarray]]:
    """Up to `count` held-out files of the corpus with at least `min_tokens` tokens: (relative name, ids)."""
    _, files = corpus_split(name, prose)
    documents = []
    for path in files:
        text = _read(path)
        if not text or len(text) < min_tokens * 2:  # far fewer characters than needed: skip before tokenizing
            continue
        ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
        if len(ids) >= min_tokens:
            documents.append((path.name, ids))
        if len(documents) == count:
            break
    if not documents:
        raise ValueError(f"no held-out {name} file has {min_tokens} tokens")
    return documents


@dataclass
class TrainingText:
    """Micro-batches of `length` tokens drawn from the training streams of both corpora, as a pure function of the
    batch index (the `batch_stream` of `tapelm.training.loop.train`)."""

    streams: dict[str, np.ndarray]
    length: int
    batch_size: int = 1
    seed: int = 0

    @classmethod
    def build(
        cls,
        tokenizer,
        length: int,
        train_tokens: int,
        batch_size: int = 1,
        seed: int = 0,
        corpora: tuple[str, ...] = CORPORA,
        prose: str | None = None,
    ) -> TrainingText:
        streams = {name: training_stream(tokenizer, name, train_tokens, seed, prose) for name in corpora}
        for name, stream in streams.items():
            if len(stream) <= length:
                raise ValueError(f"the {name} training stream has {len(stream)} tokens, fewer than length={length}")
        return cls(streams, length, batch_size, seed)

    def __call__(self, index: int) -> dict[str, torch.Tensor]:
        names = sorted(self.streams)
        rng = np.random.default_rng([self.seed, index])
        rows = []
        for row in range(self.batch_size):
            stream = self.streams[names[(index * self.batch_size + row) % len(names)]]
            start = int(rng.integers(0, len(stream) - self.length + 1))
            rows.append(stream[start : start + self.length])
        ids = torch.from_numpy(np.stack(rows))
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
