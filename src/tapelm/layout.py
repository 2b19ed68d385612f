"""Where the real tokens of a padded batch are, so that per-token work skips the padding.

Norms, projections and the MLP act on each token alone, so in a padded batch they can run on the real tokens only,
gathered into one (T, C) matrix; only attention (and the positional hooks, which see whole sequences) needs the
padded (B, N) grid. On short synthetic tasks padding is a quarter of a batch or more, and a step's time is close to
linear in the rows of its matrix multiplies. The function is unchanged for every real token: padding keys are masked
in attention, and padding positions (zeros on the grid) feed nothing a real token reads.

Which tokens are real, and where packed documents begin, the batch maker knows on the host. A `HostLayout` made
there (`HostLayout.of`) travels with the batch as the model's keyword argument `host_layout`, so that a forward pass
reads none of it back from the device: a training step then never waits on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from .kernels.attention import Segments
from .masks import tracing


class TokenLayout:
    """Converts between the padded grid (B, N, ...) and the real tokens (T, ...) of one forward pass.

    Without padding (or for single-token steps) both directions return their input: per-token work then runs on
    the grid, as it would anyway. While tracing, per-token work runs on the whole grid and `unpack` zeroes the
    padding positions (`zeroed`, (B, N)), so that a traced program computes there what eager code does: the zeros
    the projections scatter to the grid, and so the same cache."""

    def __init__(self, batch: int, length: int, index: torch.Tensor | None = None, zeroed: torch.Tensor | None = None):
        self.batch, self.length = batch, length
        self.index = index  # the real tokens' flat indices into the (B x N) grid
        self.zeroed = zeroed

    @classmethod
    def of(
        cls, token_mask: torch.Tensor | None, batch: int, length: int, index: torch.Tensor | None = None
    ) -> TokenLayout:
        """The layout of a pass whose new tokens are real where `token_mask` (B, N) is True (None: all real);
        `index`, the real tokens' flat indices when the host knew them (`HostLayout.index`), else found on the device.
        While tracing (torch.export, torch.compile) nothing is skipped, the real tokens' count being data: padding
        positions are zeroed instead."""
        if token_mask is None or length == 1:
            return cls(batch, length)
        if tracing(token_mask):
            return cls(batch, length, zeroed=token_mask)
        if index is None and not bool(token_mask.all()):
            index = token_mask.flatten().nonzero().squeeze(1)
        return cls(batch, length, index)

    @property
    def packed(self) -> bool:
        return self.index is not None

    def pack(self, grid: torch.Tensor) -> torch.Tensor:
        """(B, N, ...) -> (T, ...): the real tokens in row-major order."""
        if self.index is None:
            return grid
        return grid.flatten(0, 1).index_select(0, self.index)

    def unpack(self, tokens: torch.Tensor) -> torch.Tensor:
        """(T, ...) -> (B, N, ...), zeros at padding."""
        if self.zeroed is not None:
            return tokens * self.zeroed.view(*self.zeroed.shape, *(1,) * (tokens.dim() - 2)).to(tokens.dtype)
        if self.index is None:
            return tokens
        grid = tokens.new_zeros(self.batch * self.length, *tokens.shape[1:])
        return grid.index_copy(0, self.index, tokens).unflatten(0, (self.batch, self.length))


@dataclass(frozen=True)
class HostLayout:
    """What the batch maker knows on the host about a batch of B rows of N tokens, for the model's keyword argument
    `host_layout`: whether some token is padding (`padded`) and the real tokens' flat indices (`index`, int64, None
    without padding); whether some row packs several documents (`documents`) and their cumulative lengths as
    `cu_seq_lens_q` gives them (`cu_seq_lens`); how the mask cuts the B x N tokens into causal sequences (`segments`,
    for fla's kernels); the documents of the fullest row and 1 + the largest position the model gives a token
    (`extent`, for RandPE's draw and the learned table's bound); the distinct rows of those positions (`distinct`,
    for FIRE: each one's first row, in sorted order, and every row's index among them). Its tensors move with the
    batch (`to`, `pin_memory`, as a training loop moves a batch's tensors); everything else stays Python values."""

    shape: tuple[int, int]
    padded: bool
    index: torch.Tensor | None
    documents: bool
    cu_seq_lens: tuple[int, ...] | None
    segments: Segments
    extent: tuple[int, int]
    distinct: tuple[torch.Tensor, torch.Tensor]

    @classmethod
    def of(
        cls,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
    ) -> HostLayout:
        """The layout of a batch given as its CPU tensors (`input_ids` for its shape only): padding from a 2D
        `attention_mask`, packed documents from `position_ids` (transformers' rule, without a mask) or
        `cu_seq_lens_q` (one row), as the model reads them."""
        batch, length = input_ids.shape[:2]
        real = None if attention_mask is None else attention_mask.bool().numpy()
        if real is not None and real.shape != (batch, length):
            raise ValueError(f"attention_mask {real.shape} must be 2D (batch, length) = {(batch, length)}")
        starts, bounds, documents = None, None, 1
        if cu_seq_lens_q is not None:
            bounds = tuple(cu_seq_lens_q.tolist())
            starts = np.zeros((batch, length), dtype=bool)
            starts[0, [b for b in bounds[:-1] if 0 <= b < length]] = True
            documents = int(np.searchsorted(bounds[1:], length - 1, side="right")) + 1
        elif position_ids is not None and real is None:
            ids = position_ids.expand(batch, -1).numpy()
            starts = (np.diff(ids, axis=1, prepend=ids[:, :1] - 1) != 1) | (np.arange(length) == 0)
            documents = int(starts.sum(1).max())
        padded = real is not None and not real.all()
        positions = _positions(batch, length, real, position_ids, bounds)
        _, first, inverse = np.unique(positions, axis=0, return_index=True, return_inverse=True)
        return cls(
            shape=(batch, length),
            padded=padded,
            index=torch.from_numpy(np.flatnonzero(real)) if padded else None,
            documents=starts is not None and bool(starts[:, 1:].any()),
            cu_seq_lens=bounds,
            segments=_segments(real if padded else None, starts, batch, length),
            extent=(documents, int(positions.max()) + 1),
            distinct=(torch.from_numpy(first), torch.from_numpy(inverse.reshape(-1))),
        )

    def to(self, device, non_blocking: bool = False) -> HostLayout:
        """The layout with its tensors on `device` (its other fields stay on the host)."""
        return replace(self, **self._moved(lambda x: x.to(device, non_blocking=non_blocking)))

    def pin_memory(self) -> HostLayout:
        """The layout with its tensors in page-locked memory (copies to a GPU then run without blocking)."""
        return replace(self, **self._moved(torch.Tensor.pin_memory))

    def _moved(self, move) -> dict:
        cuts = self.segments.cuts
        return {
            "index": None if self.index is None else move(self.index),
            "distinct": tuple(move(x) for x in self.distinct),
            "segments": replace(self.segments, cuts=move(cuts) if isinstance(cuts, torch.Tensor) else cuts),
        }

    def check(
        self, batch: int, length: int, attention_mask: torch.Tensor | None, cached: bool, device: torch.device
    ) -> None:
        """Refuse a layout that does not describe this call's batch, or whose tensors are elsewhere (ValueError)."""
        if self.shape != (batch, length):
            raise ValueError(f"host_layout describes a batch of shape {self.shape}, not this one's {(batch, length)}")
        if self.distinct[0].device != device:
            raise ValueError(
                f"host_layout's tensors are on {self.distinct[0].device}, the batch on {device}: move it with the "
                "batch (host_layout.to(device))"
            )
        if cached:
            raise ValueError("host_layout describes a batch without cached tokens; pass it with no cache")
        if self.padded and (attention_mask is None or attention_mask.dim() != 2):
            raise ValueError("host_layout says the batch is padded: pass its 2D attention_mask")


def _positions(batch: int, length: int, real, position_ids: torch.Tensor | None, bounds) -> np.ndarray:
    """The positions (B, N) the model gives the tokens (`TapeModel._position_ids`): the given ones, those within each
    document of `cu_seq_lens_q`, those counted over the real tokens, or 0 to N - 1."""
    if position_ids is not None:
        return position_ids.expand(batch, -1).numpy()
    index = np.arange(length)
    if bounds is not None:
        return (index - np.asarray(bounds)[np.searchsorted(bounds[1:], index, side="right")])[None]
    if real is not None:
        return np.maximum(np.cumsum(real, axis=1) - 1, 0)
    return np.broadcast_to(index, (batch, length))


def _segments(real: np.ndarray | None, starts: np.ndarray | None, batch: int, length: int) -> Segments:
    """`tapelm.kernels.fla_layout.segments`' answer for the causal mask of real tokens `real` (B, N) (padding sees
    itself and the real tokens before it) or of documents beginning where `starts` (B, N) is True, found on the host.
    """
    if real is not None:
        before = np.cumsum(real, axis=1) - real  # real tokens before each token
        index = np.arange(length)
        first = index - before  # the first key each token sees, if those before it are one run
        one_run = np.take_along_axis(before, first, axis=1) == 0
        starts = before == 0
        follows = np.concatenate([starts[:, :1], first[:, 1:] == first[:, :-1]], axis=1)
        if not (one_run & (starts | follows)).all():
            return Segments(False, 0)
    if starts is None or starts.sum() == batch:
        return Segments(None, length)
    cuts = np.append(np.flatnonzero(starts), batch * length)
    return Segments(torch.from_numpy(cuts), int(np.diff(cuts).min()))


__all__ = ["HostLayout", "TokenLayout"]
