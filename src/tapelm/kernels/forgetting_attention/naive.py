"""FoX's attention in plain PyTorch, the reference: the decoder's attention with the additive bias c_i - c_j =
sum_{s=j+1..i} log f_s, c the cumulative log forget gates, built for any block of queries."""

from __future__ import annotations

import torch

from ..attention import RowBias


def forgetting_bias(cumulative: torch.Tensor, every: torch.Tensor, dtype: torch.dtype) -> RowBias:
    """The bias c_i - c_j from the new queries' cumulative log gates (B, H, N, 1) and every key's (B, H, 1, T)."""
    return RowBias(
        lambda start, end, keys: (cumulative[..., start:end, :] - every[..., :keys]).to(dtype), cumulative.shape[-2]
    )


__all__ = ["forgetting_bias"]
