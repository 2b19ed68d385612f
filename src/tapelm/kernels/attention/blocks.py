"""Attention a block of queries at a time for a bias given as a `RowBias` (fast path "attention-blocks"): each
block's bias is built inside an activation checkpoint, so no N x T tensor per head is kept for the backward pass."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .inputs import AttentionMask, RowBias, seen_keys

BIAS_BLOCK = 128
"""Queries per block of `chunked_bias_attention`: in single training steps timed at bench speed's small size, 128
was faster than 256 and than 64 for CoPE and FoX (not a committed measurement; docs/SPEED.md has the result)."""


def chunked_bias_attention(q, k, v, mask: AttentionMask, bias: RowBias, attend_rows) -> torch.Tensor:
    """`attend_rows(q, k, v, mask, bias)`, the attention of a block of queries with its bias as a tensor, a block of
    `BIAS_BLOCK` queries at a time over the keys up to the last one the block sees (a causal block skips the later
    keys), each block's bias built from its rows. With gradients each block runs inside an
    activation checkpoint: the backward pass builds the block's bias and attention again, so what is kept between
    the passes is q, k, v and the output, never an N x T tensor per head."""
    blocks = []
    for start in range(0, q.shape[-2], BIAS_BLOCK):
        end = min(start + BIAS_BLOCK, q.shape[-2])
        valid = mask.valid[..., start:end, :]
        keys = seen_keys(valid)
        rows = AttentionMask(valid[..., :keys], False)

        def block(q_rows, start=start, end=end, rows=rows, keys=keys):
            return attend_rows(q_rows, k[..., :keys, :], v[..., :keys, :], rows, bias.rows(start, end, keys))

        q_rows = q[..., start:end, :]
        blocks.append(checkpoint(block, q_rows, use_reentrant=False) if torch.is_grad_enabled() else block(q_rows))
    return torch.cat(blocks, dim=-2)




__all__ = ["BIAS_BLOCK", "chunked_bias_attention"]
