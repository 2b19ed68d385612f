"""Real text for retrofitting a pretrained model, tokenized with the model's own tokenizer.

Two corpora, both split by file exactly as the `text` task splits them (sorted files; file i is held out when
i % VAL_EVERY == 0), so no held-out file is ever trained on:

- "code": the Python standard library's *.py files (always present; `tasks.text.corpus_files(None)`).
- "prose": the reStructuredText sources of the Python 3.11 documentation (English prose with some code), from
  Debian's python3.11-doc package, fetched at run time with ``apt-get download`` and unpacked with ``dpkg-deb -x``
  into the tapelm cache (never committed); or any file tree given as `prose` (`tapelm finetune --prose-corpus`),
  e.g. on a machine without apt-get.

Training: a stream per corpus of whole training files in a seeded shuffled order, separated by the tokenizer's eos,
cut after `train_tokens` tokens; a micro-batch is a window of `length` tokens from one corpus (alternating), at a
position drawn from the batch index, so batches are a pure function of the index (resumable, identical for every
method). Evaluation: whole held-out files that are long enough, each tokenized on its own.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..experiments.tasks.text import VAL_EVERY, corpus_files
from .sources import cache_root

logger = logging.getLogger(__name__)

DOC_PACKAGE = "python3.11-doc"
CORPORA = ("code", "prose")


PROSE_OPTION = "--prose-corpus"


def python_docs(root: Path | None = None) -> Path:
    """The folder of python3.11-doc's .rst.txt sources, fetched and unpacked into the tapelm cache on first use;
    ValueError naming PROSE_OPTION when it cannot be fetched."""
    root = Path(root) if root is not None else cache_root() / DOC_PACKAGE
    sources = root / "usr/share/doc/python3.11/html/_sources"
    if sources.is_dir():
        return sources
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise ValueError(f"the default prose corpus is Debian's {DOC_PACKAGE}, and apt-get / dpkg-deb are not "
                         f"available here to fetch it; pass {PROSE_OPTION} FOLDER (a tree of text files) instead")
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=".tmp-doc-") as tmp:
        logger.warning("tapelm: fetching %s with apt-get download into %s (once)", DOC_PACKAGE, root)
        done = subprocess.run(["apt-get", "download", DOC_PACKAGE], cwd=tmp, capture_output=True, text=True)
        debs = list(Path(tmp).glob("*.deb"))
        if done.returncode != 0 or len(debs) != 1:
            reason = (done.stderr.strip().splitlines() or ["no package downloaded"])[-1][-200:]
            raise ValueError(f"apt-get download {DOC_PACKAGE} (the default prose corpus) failed ({reason}); pass "
                             f"{PROSE_OPTION} FOLDER (a tree of text files) instead")
        staged = Path(tmp) / "x"
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(staged)], check=True)
        if root.exists():
            shutil.rmtree(root)
        staged.rename(root)
    if not sources.is_dir():
        raise RuntimeError(f"{DOC_PACKAGE} did not contain {sources}")
    return sources


def corpus_split(name: str, prose: str | None = None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of a corpus, split like the `text` task. `prose`: a file tree (or glob) to
    use as the prose corpus instead of python3.11-doc."""
    if name == "code":
        files = corpus_files(None)
    elif name == "prose" and prose is not None:
        if not any(char in prose for char in "*?[") and not Path(prose).exists():
            raise ValueError(f"{PROSE_OPTION} '{prose}' does not exist; give a folder of text files or a glob")
        files = corpus_files(prose)
    elif name == "prose":
        files = corpus_files(str(python_docs() / "**" / "*.rst.txt"))
    else:
        raise ValueError(f"corpus={name!r} is not allowed; choose one of: {', '.join(CORPORA)}")
    files = list(files)
    if len(files) < 2:
        raise ValueError(f"the {name} corpus has {len(files)} file; it needs at least 2 (file i is held out when "
                         f"i % {VAL_EVERY} == 0, the others are trained on)")
    return [f for i, f in enumerate(files) if i % VAL_EVERY], files[::VAL_EVERY]


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


def held_out_documents(tokenizer, name: str, min_tokens: int, count: int,
                       prose: str | None = None) -> list[tuple[str, np.ndarray]]:
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
    batch index (the `batch_stream` of `tapelm.experiments.train.train`)."""

    streams: dict[str, np.ndarray]
    length: int
    batch_size: int = 1
    seed: int = 0

    @classmethod
    def build(cls, tokenizer, length: int, train_tokens: int, batch_size: int = 1, seed: int = 0,
              corpora: tuple[str, ...] = CORPORA, prose: str | None = None) -> TrainingText:
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
