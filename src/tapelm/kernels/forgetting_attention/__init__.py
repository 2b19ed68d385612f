"""FoX's attention softmax(q k^T scale + c_i - c_j) v: the reference (`naive`, the decoder's attention with FoX's
bias) and fla's kernel ("forgetting-attention-fla")."""

from __future__ import annotations

import torch

from .. import candidates, first
from ..attention import RowBias
from .naive import forgetting_bias


def _fla(q, k, v, log_gates, mask, scale):
    from .fla import forgetting_attention

    return forgetting_attention(q, k, v, log_gates, mask, scale)


CANDIDATES = candidates("forgetting-attention", ("fla", _fla))


def forgetting_attention_bias(
    log_gates: torch.Tensor, cumulative: torch.Tensor, every: torch.Tensor, dtype: torch.dtype
) -> RowBias:
    """FoX's bias (`naive.forgetting_bias`) for the new tokens' log gates (B, H, N), their cumulative sums
    (B, H, N, 1) and every key's (B, H, 1, T); as its `kernel`, the first candidate that is on and takes the
    attention call."""
    bias = forgetting_bias(cumulative, every, dtype)
    bias.kernel = lambda q, k, v, mask, scale, paths: first(CANDIDATES, paths, q, k, v, log_gates, mask, scale)
    return bias


__all__ = ["CANDIDATES", "forgetting_attention_bias"]
