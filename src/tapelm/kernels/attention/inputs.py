"""What attention reads besides q, k and v: which keys each query sees (`AttentionMask`) and an additive logit bias,
a tensor or a `RowBias` that builds any block of queries' rows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segments:
    """How the batch's B x N tokens, laid out as one row, cut into causal sequences, as the batch maker knew it on the
    host (`tapelm.kernels.fla_layout.segments`'s answer, found without reading the device): `cuts` the cumulative
    lengths (int64, on the device) or None (every row one sequence) or False (no such cut), `shortest` the shortest
    sequence's length (0 when `cuts` is False)."""

    cuts: torch.Tensor | None | bool
    shortest: int


@dataclass
class AttentionMask:
    """Which keys each query may see: `valid` (B, 1, N, T) booleans, or None with `is_causal` meaning SDPA's own
    causal mask (no padding, no cache offset) and `is_causal=False` meaning every key. `segments`: how a causal mask
    without cached keys cuts the batch into sequences, when the host knew it (None: read from `valid`)."""

    valid: torch.Tensor | None
    is_causal: bool
    segments: Segments | None = None

    def keys_seen(self, queries: int, keys: int, device: torch.device) -> torch.Tensor:
        """How many keys each of the `queries` new queries sees among `keys`, as float32 (B or 1, 1, N, 1): what a
        softmax row is normalised over (padding, other documents and later keys left out; at least 1)."""
        if self.valid is not None:
            return self.valid.sum(-1, keepdim=True, dtype=torch.float32)
        if self.is_causal:  # SDPA's own causal mask: no cache, no padding
            return torch.arange(1, queries + 1, dtype=torch.float32, device=device).view(1, 1, queries, 1)
        return torch.full((1, 1, queries, 1), float(keys), device=device)


class RowBias:
    """An additive logit bias (B or 1, H, N, T) given by a function of a block of queries: `rows(start, end, keys)` is
    bias[..., start:end, :keys] (keys None: every key). Attention can build it a block at a time (and again in the
    backward pass), over the keys that block sees, instead of keeping all of it; `full()` is the whole tensor (the
    reference path, explicit attention, a short sequence).
    `kernel(q, k, v, mask, scale, paths)`, where given, is the same attention through the encoding's own operation
    (FoX's, PaTH's: `tapelm.kernels.forgetting_attention`, `path_attention`), returning None where none of its fast
    paths takes the call."""

    def __init__(
        self,
        rows: Callable[[int, int, int | None], torch.Tensor],
        queries: int,
        kernel: Callable[..., torch.Tensor | None] | None = None,
    ):
        self.rows, self.queries, self.kernel = rows, queries, kernel

    def full(self) -> torch.Tensor:
        return self.rows(0, self.queries, None)

    @staticmethod
    def add(first, second):
        """The sum of two biases, each a tensor, a `RowBias` or None."""
        if first is None or second is None:
            return second if first is None else first
        if not isinstance(first, RowBias) and not isinstance(second, RowBias):
            return first + second
        queries = first.queries if isinstance(first, RowBias) else second.queries
        return RowBias(
            lambda start, end, keys: _rows(first, start, end, keys) + _rows(second, start, end, keys), queries
        )


def _rows(bias, start: int, end: int, keys: int | None) -> torch.Tensor:
    return bias.rows(start, end, keys) if isinstance(bias, RowBias) else bias[..., start:end, :keys]


def scale_rows(bias, factor: torch.Tensor):
    """A bias (a tensor, a `RowBias` or None) with each query's row multiplied by `factor` (B or 1, H or 1, N, 1)."""
    if bias is None or not isinstance(bias, RowBias):
        return None if bias is None else bias * factor
    return RowBias(lambda start, end, keys: bias.rows(start, end, keys) * factor[..., start:end, :], bias.queries)


def materialized(bias):
    """A bias as one tensor (None stays None)."""
    return bias.full() if isinstance(bias, RowBias) else bias


def with_bias(mask: AttentionMask, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The boolean mask, or the float mask that adds `bias` where keys are visible."""
    if bias is None:
        return mask.valid
    return torch.where(mask.valid, bias, float("-inf"))


def seen_keys(valid: torch.Tensor) -> int:
    """1 + the last key any query of `valid` (B, 1 or H, n, T) sees, at least 1 (T while compiling: no branch on
    data)."""
    if torch.compiler.is_compiling():
        return valid.shape[-1]
    seen = valid.flatten(0, -2).any(0).nonzero()
    return int(seen[-1]) + 1 if len(seen) else 1


__all__ = ["AttentionMask", "RowBias", "Segments", "materialized", "scale_rows", "seen_keys", "with_bias"]
