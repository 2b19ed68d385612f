"""PaTH's attention: the reference (`naive`: its logits a block of queries at a time, handed to the decoder's
attention as an additive bias over a zero query) and fla's kernel ("path-attention-fla", which reads the raw queries
and keys)."""

from __future__ import annotations

import torch

from ...fast_paths import FastPaths
from .. import candidates, first
from ..attention import RowBias
from .naive import CHUNK, PathLogits, path_logits


def _fla(q, keys, raw_keys, v, w, beta, mask, scale):
    from .fla import path_attention

    return path_attention(q, keys, raw_keys, v, w, beta, mask, scale)


CANDIDATES = candidates("path-attention", ("fla", _fla))


def path_attention_bias(
    logits: PathLogits, q: torch.Tensor, raw_keys: torch.Tensor, w: torch.Tensor, beta: torch.Tensor, scale: float
) -> RowBias:
    """PaTH's scaled logits as the bias (B, H, N, T) of an attention call with a zero query, built from `logits` for
    any block of queries; as its `kernel`, the first candidate that is on and takes the call, given the raw queries
    q (B, H, N, d), keys (B, Hkv, N, d), Householder vectors w and strengths beta."""

    def rows(start: int, end: int, keys: int | None) -> torch.Tensor:
        return (logits.rows(start, end, keys) * scale).flatten(1, 2).to(q.dtype)

    def kernel(_zero_queries, every_key, v, mask, _scale, paths: FastPaths):
        return first(CANDIDATES, paths, q, every_key.shape[-2], raw_keys, v, w, beta, mask, scale)

    return RowBias(rows, q.shape[-2], kernel)


__all__ = ["CANDIDATES", "CHUNK", "PathLogits", "path_attention_bias", "path_logits"]
