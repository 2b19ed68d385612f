"""Examples and batches: one unpadded token sequence with its loss targets, and left-padded batches of them, as every
task, fine-tuning set and evaluation feeds the model."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .tokenization import Tokenizer

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Batch:
    """LongTensors of shape (batch, seq), left-padded.

    `labels` equals `input_ids` where the loss applies and IGNORE_INDEX elsewhere (tagging tasks such as the word
    problem put their own label there instead); it is not shifted (the model predicts labels[:, t] from positions
    < t). `attention_mask` is 1 on real tokens.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.input_ids.to(device), self.labels.to(device), self.attention_mask.to(device))


class Example(NamedTuple):
    """One unpadded sequence: token ids and, per token, whether the loss applies; `labels`, when given, are the
    label ids of a tagging task (one per token; the label at a target token is what the positions before it must
    predict), otherwise the labels are the ids themselves (language modelling of the target tokens)."""

    ids: list[int]
    targets: list[bool]
    labels: list[int] | None = None

    @classmethod
    def from_segments(cls, tokenizer: Tokenizer, segments: Iterable[tuple[str, bool]]) -> Example:
        """Encode (text, is_target) pieces in order and concatenate them."""
        ids: list[int] = []
        targets: list[bool] = []
        for text, is_target in segments:
            piece = tokenizer.encode(text)
            ids += piece
            targets += [is_target] * len(piece)
        return cls(ids, targets)


def collate(examples: Sequence[Example], pad_id: int) -> Batch:
    """Left-pad `examples` to a common length."""
    lengths = np.array([len(example.ids) for example in examples])
    width = int(lengths.max())
    ids = np.full((len(examples), width), pad_id, dtype=np.int64)
    label_ids = np.full((len(examples), width), pad_id, dtype=np.int64)
    targets = np.zeros((len(examples), width), dtype=bool)
    for row, example in enumerate(examples):
        ids[row, width - lengths[row] :] = example.ids
        label_ids[row, width - lengths[row] :] = example.ids if example.labels is None else example.labels
        targets[row, width - lengths[row] :] = example.targets
    attention_mask = np.arange(width)[None, :] >= (width - lengths)[:, None]
    return Batch(
        torch.from_numpy(ids),
        torch.from_numpy(np.where(targets, label_ids, IGNORE_INDEX)),
        torch.from_numpy(attention_mask.astype(np.int64)),
    )


__all__ = ["IGNORE_INDEX", "Batch", "Example", "collate"]
