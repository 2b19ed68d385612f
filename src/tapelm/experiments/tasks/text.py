"""Language modelling on real text, evaluated by sliding-window perplexity at growing lengths.

Corpus: one source or a list of sources of `tapelm.experiments.tasks.corpora` (a named corpus such as "stdlib",
the default, or "python-docs", a file, a directory or a glob), split source by source as that module says; files
that are not UTF-8 are skipped. A list trains on every source's training files and validates on every source's
held-out ones. The tokenizer ("byte", or "bpe": a byte-level BPE trained on the training split
only, or the one a run saved, `saved_tokenizer`, which is never retrained) and the token streams are cached in memory
per corpus.

Training batches are uniform random windows of train_length tokens of the training stream, every token
labelled. A condition's perplexity scores n * train_length held-out tokens (from an offset fixed by the seed, the
same for every length; for any seed but the test set's, `TEST_SEED`, a span that shares no token with the test set's
span of the same n where the stream has room, `validation_apart`, so that a validation set is apart from it) with
windows of the condition's length moved by
`stride` (default half the length): each window labels only the tokens the previous one did not, so every token but
the first of the span is scored exactly once, always with at least length - stride tokens of context once past the
start.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...data.corpora import VAL_EVERY, corpus_sources
from ...data.tokenization import BackendTokenizer, ByteTokenizer, Tokenizer, load_tokenizer
from .base import (
    IGNORE_INDEX,
    TEST_SEED,
    Batch,
    Condition,
    Example,
    LogitsFn,
    Task,
    check_eval_sizes,
    collate,
)
from .options import check_choice, check_int, check_multipliers

TOKENIZERS = ("byte", "bpe")
DEFAULT_TOKENIZER = "byte"


def _read_texts(files: tuple[Path, ...]) -> list[str]:
    texts = []
    for path in files:
        try:
            texts.append(path.read_text("utf-8"))
        except UnicodeDecodeError:
            continue
    return texts


def split_texts(texts: list[str]) -> tuple[list[str], list[str]]:
    """(train, validation) texts of one source; see `tapelm.experiments.tasks.corpora`."""
    if len(texts) == 1:
        cut = len(texts[0]) - len(texts[0]) // VAL_EVERY
        return [texts[0][:cut]], [texts[0][cut:]]
    return [t for i, t in enumerate(texts) if i % VAL_EVERY], texts[::VAL_EVERY]


def _stream(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    return np.concatenate([np.asarray(tokenizer.encode(text), dtype=np.int64) for text in texts])


@lru_cache(maxsize=4)
def _load(
    sources: tuple[tuple[Path, ...], ...], tokenizer: str, bpe_vocab_size: int, saved: Path | None
) -> tuple[Tokenizer, np.ndarray, np.ndarray]:
    """(tokenizer, training stream, validation stream) for one corpus (its sources' files) and tokenizer choice (the
    BPE saved in `saved` when given)."""
    train, validation = [], []
    for files in sources:
        texts = _read_texts(files)
        if not texts:
            raise ValueError(f"corpus holds no UTF-8 text files (first file: '{files[0]}')")
        source_train, source_validation = split_texts(texts)
        train += source_train
        validation += source_validation
    if tokenizer == "byte":
        encoder: Tokenizer = ByteTokenizer()
    elif saved is not None:
        encoder = load_tokenizer(saved)
    else:
        encoder = BackendTokenizer.train_bpe(train, bpe_vocab_size)
    return encoder, _stream(encoder, train), _stream(encoder, validation)


@lru_cache(maxsize=4)
def _digest(sources: tuple[tuple[Path, ...], ...], tokenizer: str, bpe_vocab_size: int, saved: Path | None) -> str:
    """sha256 of a corpus's training and held-out token streams (a corpus named by a path, or the standard library
    of another Python, may hold other text on another machine)."""
    _, train, validation = _load(sources, tokenizer, bpe_vocab_size, saved)
    digest = hashlib.sha256()
    for stream in (train, validation):
        digest.update(len(stream).to_bytes(8, "little"))
        digest.update(np.ascontiguousarray(stream).tobytes())
    return digest.hexdigest()


def sliding_windows(total: int, length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) windows over `total` tokens: tokens first_scored..end-1 are scored in
    window begin..end-1. Windows have min(length, total) tokens; every token but the first is scored once."""
    if not 1 <= stride < length:
        raise ValueError(f"stride={stride} is not allowed; it must be in [1, {length - 1}] for length {length}")
    windows, end, first = [], min(length, total), 1
    while True:
        windows.append((max(0, end - length), end, first))
        if end >= total:
            return windows
        first, end = end, min(end + stride, total)


class TextTask(Task):
    name = "text"
    metric_name = "perplexity"
    evaluation_options = ("eval_multipliers", "stride")

    def __init__(
        self,
        corpus: str | list[str] | None = None,
        train_length: int = 256,
        tokenizer: str = DEFAULT_TOKENIZER,
        bpe_vocab_size: int = 1024,
        eval_multipliers: tuple[int, ...] = (1, 2, 4, 8),
        stride: int | None = None,
        *,
        saved_tokenizer: str | Path | None = None,
    ) -> None:
        """`saved_tokenizer`: a folder holding the BPE a run trained (`save_tokenizer`), used instead of training one
        (not an option of the task: the run's identity is its options)."""
        self.train_length = check_int("train_length", train_length, 2, 10**6)
        check_choice("tokenizer", tokenizer, TOKENIZERS)
        vocab = check_int("bpe_vocab_size", bpe_vocab_size, 257, 65536) if tokenizer == "bpe" else 0
        self.eval_multipliers = check_multipliers("eval_multipliers", eval_multipliers)
        self.stride = None if stride is None else check_int("stride", stride, 1, self.train_length - 1)
        saved = None if saved_tokenizer is None else Path(saved_tokenizer).resolve()
        self._source = (corpus_sources(corpus), tokenizer, vocab, saved)
        self.tokenizer, self.train_stream, self.validation_stream = _load(*self._source)
        if len(self.train_stream) < self.train_length or len(self.validation_stream) < 2:
            raise ValueError(
                f"corpus '{corpus or 'standard library'}' is too small: {len(self.train_stream)} training tokens "
                f"(train_length={self.train_length}) and {len(self.validation_stream)} validation tokens"
            )

    @classmethod
    def tokenizer_is_trained(cls, options: dict[str, Any]) -> bool:
        return options.get("tokenizer", DEFAULT_TOKENIZER) == "bpe"

    def data_record(self) -> dict[str, Any]:
        return {
            "training_tokens": len(self.train_stream),
            "held_out_tokens": len(self.validation_stream),
            "streams_sha256": _digest(*self._source),
        }

    def eval_conditions(self) -> list[Condition]:
        return [{"length": self.train_length * multiplier} for multiplier in self.eval_multipliers]

    def train_batch(self, rng: np.random.Generator, batch_size: int) -> Batch:
        check_int("batch_size", batch_size, 1, 10**9)
        starts = rng.integers(0, len(self.train_stream) - self.train_length + 1, size=batch_size)
        ids = torch.from_numpy(np.stack([self.train_stream[s : s + self.train_length] for s in starts]))
        return Batch(ids, ids.clone(), torch.ones_like(ids))

    def eval_batches(self, condition: Condition, seed: int, n: int, batch_size: int) -> Iterator[Batch]:
        check_eval_sizes(n, batch_size)
        span = self._eval_span(seed, n)
        length = condition["length"]
        if len(span) < length:
            raise ValueError(
                f"n={n} gives {len(span)} held-out tokens, fewer than the eval length {length}; raise n "
                "or use a larger corpus"
            )
        windows = sliding_windows(len(span), length, self.stride or length // 2)
        examples = [
            Example(span[begin:end].tolist(), [i >= first for i in range(begin, end)]) for begin, end, first in windows
        ]
        for start in range(0, len(examples), batch_size):
            yield collate(examples[start : start + batch_size], self.tokenizer.pad_id)

    def validation_apart(self, n: int) -> bool:
        """Whether the held-out stream has room for a span of n * train_length tokens apart from the test set's."""
        before, after, _, _ = self._offsets_apart(n)
        return before + after > 0

    def _offsets_apart(self, n: int) -> tuple[int, int, int, int]:
        """(offsets before the test set's span, offsets after it, the test span's offset, the span size) for n."""
        total = len(self.validation_stream)
        size = min(n * self.train_length, total)
        test = int(np.random.default_rng(TEST_SEED).integers(0, total - size + 1))
        return max(0, test - size + 1), max(0, total - size - (test + size) + 1), test, size

    def _eval_span(self, seed: int, n: int) -> np.ndarray:
        """n * train_length held-out tokens (fewer if the held-out stream is shorter), placed by `seed`: for the test
        set's seed anywhere; for any other among the offsets whose span shares no token with the test set's where
        the stream has room (`validation_apart`), else anywhere."""
        before, after, test, size = self._offsets_apart(n)
        if seed == TEST_SEED:
            return self.validation_stream[test : test + size]
        rng = np.random.default_rng(seed)
        if before + after == 0:
            offset = int(rng.integers(0, len(self.validation_stream) - size + 1))
        else:
            drawn = int(rng.integers(0, before + after))
            offset = drawn if drawn < before else test + size + drawn - before
        return self.validation_stream[offset : offset + size]

    @torch.no_grad()
    def evaluate_condition(
        self, logits_fn: LogitsFn, condition: Condition, seed: int, n: int, batch_size: int
    ) -> tuple[float, int]:
        """(perplexity, number of scored tokens)."""
        total_nll, count = 0.0, 0
        for batch in self.eval_batches(condition, seed, n, batch_size):
            logits = logits_fn(batch.input_ids, batch.attention_mask)[:, :-1].float()
            labels = batch.labels.to(logits.device)[:, 1:]
            scored = labels != IGNORE_INDEX
            log_probs = torch.log_softmax(logits, dim=-1)
            nll = -log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            total_nll += nll[scored].double().sum().item()
            count += int(scored.sum())
        return math.exp(total_nll / count), count
