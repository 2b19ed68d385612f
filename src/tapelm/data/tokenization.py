"""Tokenizers for the tasks: an explicit symbol vocabulary, raw bytes, and a byte-level BPE (the `tokenizers`
library's trainer).

All three share one small interface (`Tokenizer`): `vocab_size`, `pad_id`, `encode(str) -> list[int]`,
`decode(list[int]) -> str` (drops padding) and `to_transformers()`: the same tokenizer as a transformers
`PreTrainedTokenizerFast`, which a run saves beside its model (`save_tokenizer`) so that `AutoTokenizer` loads it and
an evaluation reuses it (`load_tokenizer`). The symbol and byte tokenizers encode in Python (a training batch calls
them once per example piece); their transformers twins encode identically.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
TOKENIZER_FILE = "tokenizer.json"


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def to_transformers(self) -> PreTrainedTokenizerFast: ...


def _transformers(
    backend: Backend, bos: str | None = None, eos: str = PAD, literal: bool = False
) -> PreTrainedTokenizerFast:
    """`backend` as a transformers tokenizer with PAD as padding token. None is added to the text (the tasks write
    their own symbols); `eos` is what clients such as lm-evaluation-harness need one for (to start an empty
    context, to stop generating): without an end-of-sequence symbol, the padding token doubles as one, as in
    `tapelm.scrolls`. `literal`: text that spells a special token ("<pad>") is encoded as plain text, not as that
    token (saved with the tokenizer)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, bos_token=bos, eos_token=eos, split_special_tokens=literal
    )


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

    def to_transformers(self) -> PreTrainedTokenizerFast:
        """A word-level model over the same longest-first split (text outside the vocabulary is an error there
        too)."""
        backend = Backend(models.WordLevel(self._ids, unk_token=None))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(self._pattern.pattern), behavior="isolated")
        backend.decoder = decoders.Fuse()
        return _transformers(backend, bos=BOS, eos=EOS)


class ByteTokenizer:
    """UTF-8 bytes: ids 0-255 are the byte values and id 256 is <pad> (vocab_size 257)."""

    vocab_size = 257
    pad_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i != self.pad_id).decode("utf-8", errors="replace")

    def to_transformers(self) -> PreTrainedTokenizerFast:
        """A byte-level BPE without merges whose id of each byte is its value; like `encode`, it reads "<pad>" in the
        text as five bytes."""
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        backend = Backend(models.BPE({char: byte for byte, char in bytes_to_unicode().items()}, []))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        return _transformers(backend, literal=True)


class BackendTokenizer:
    """A `tokenizers.Tokenizer` with <pad> in its vocabulary: the byte-level BPE that `train_bpe` learns (<pad> is
    id 0 there), or any tokenizer a run saved (`load_tokenizer`)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self.vocab_size = backend.get_vocab_size()
        self.pad_id = backend.token_to_id(PAD)

    @classmethod
    def train_bpe(cls, texts: Iterable[str], vocab_size: int) -> BackendTokenizer:
        """Learn merges on `texts` up to `vocab_size` tokens (fewer when a small corpus runs out of pairs)."""
        backend = Backend(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[PAD],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        backend.train_from_iterator(texts, trainer)
        return cls(backend)

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=True)

    def to_transformers(self) -> PreTrainedTokenizerFast:
        return _transformers(self._backend)


def save_tokenizer(tokenizer: Tokenizer, directory: str | Path) -> None:
    """Write `tokenizer` (as transformers' tokenizer files) into `directory`; `AutoTokenizer` loads it."""
    tokenizer.to_transformers().save_pretrained(str(directory))


def has_saved_tokenizer(directory: str | Path) -> bool:
    return (Path(directory) / TOKENIZER_FILE).is_file()


def load_tokenizer(directory: str | Path) -> BackendTokenizer:
    """The tokenizer saved in `directory` by `save_tokenizer`; ValueError when there is none."""
    path = Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        raise ValueError(f"'{directory}' holds no saved tokenizer ({TOKENIZER_FILE})")
    return BackendTokenizer(Backend.from_file(str(path)))


def is_saved_in(tokenizer: Tokenizer, directory: str | Path) -> bool:
    """Whether `directory` holds `tokenizer` (the saved tokenizer.json and `tokenizer`'s own serialise alike)."""
    saved = json.loads((Path(directory) / TOKENIZER_FILE).read_text())
    return saved == json.loads(tokenizer.to_transformers().backend_tokenizer.to_str())
