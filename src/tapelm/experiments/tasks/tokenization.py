"""Tokenizers for the tasks: an explicit symbol vocabulary, raw bytes, and a BPE trained in memory.

All three share one small interface (`Tokenizer`): `vocab_size`, `pad_id`, `encode(str) -> list[int]`
and `decode(list[int]) -> str`; `decode` drops padding.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Protocol

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class SymbolTokenizer:
    """An explicit vocabulary: ids 0, 1, 2 are <pad>, <bos>, <eos>, then `symbols` in the given order.

    `encode` takes the longest symbol that matches at each offset, so multi-character symbols such as
    "k12" or "print " are single tokens; `decode` concatenates the symbols.
    """

    pad_id, bos_id, eos_id = 0, 1, 2

    def __init__(self, symbols: Iterable[str]) -> None:
        self.symbols = [PAD, BOS, EOS, *symbols]
        self._ids = {symbol: i for i, symbol in enumerate(self.symbols)}
        if len(self._ids) != len(self.symbols) or "" in self._ids:
            raise ValueError("symbols must be distinct non-empty strings")
        longest_first = sorted(self.symbols, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, longest_first)))
        self.vocab_size = len(self.symbols)

    def encode(self, text: str) -> list[int]:
        pieces = self._pattern.findall(text)
        if sum(map(len, pieces)) != len(text):
            raise ValueError(f"{text[:40]!r}... holds characters outside the vocabulary")
        return [self._ids[piece] for piece in pieces]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.symbols[i] for i in ids if i != self.pad_id)


class ByteTokenizer:
    """UTF-8 bytes: ids 0-255 are the byte values and id 256 is <pad> (vocab_size 257)."""

    vocab_size = 257
    pad_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i != self.pad_id).decode("utf-8", errors="replace")


class BPETokenizer:
    """Byte-level BPE trained with the `tokenizers` library on `texts`; <pad> is id 0.

    `vocab_size` is the size actually reached, which can be below the requested size on a small corpus.
    """

    def __init__(self, texts: Iterable[str], vocab_size: int) -> None:
        tokenizer = HFTokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[PAD],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(texts, trainer)
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.pad_id = tokenizer.token_to_id(PAD)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)
