"""Stick-breaking attention (Tan et al. 2025): the reference (`naive`, plain PyTorch in log space) and, in the order
they are tried, fla's kernel ("stickbreaking-attention-fla", CUDA only) and an autograd function that makes fewer
passes over the N x T weights, in place, and keeps only them for its backward pass
("stickbreaking-attention-autograd")."""

from __future__ import annotations

import torch

from ...fast_paths import FastPaths
from .. import candidates, first
from ..attention import AttentionMask
from .naive import stickbreaking_attention as naive_stickbreaking_attention
from .naive import visible_keys


def _fla(q, k, v, mask, scale, attend_current):
    from .fla import stickbreaking_attention

    return stickbreaking_attention(q, k, v, mask, scale, attend_current)


def _autograd(q, k, v, mask, scale, attend_current):
    """Over a sequence: a decoding step's one query reads each cached key and value once on the reference, where
    this path would copy them reversed."""
    if q.shape[-2] == 1:
        return None
    from .autograd import StickBreakingAttention

    visible = visible_keys(mask, q.shape[-2], k.shape[-2], attend_current, q.device)
    return StickBreakingAttention.apply(q, k, v, visible, scale)


CANDIDATES = candidates("stickbreaking-attention", ("fla", _fla), ("autograd", _autograd))


def stickbreaking_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    scale: float,
    attend_current: bool,
    paths: FastPaths,
    weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output (B, H, N, F) of q (B, H, N, d), k (B, Hkv, T, d), v (B, Hkv, T, F) and, when `weights`, the weights
    (B, H, N, T) (the reference then: no kernel returns them); through the first candidate on in `paths` that takes
    the call, else the reference."""
    if not weights:
        out = first(CANDIDATES, paths, q, k, v, mask, scale, attend_current)
        if out is not None:
            return out, None
    out, probabilities = naive_stickbreaking_attention(q, k, v, mask, scale, attend_current)
    return out, probabilities if weights else None


__all__ = ["CANDIDATES", "stickbreaking_attention"]
