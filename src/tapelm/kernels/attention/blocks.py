"""Attention a block of queries at a time for a bias given as a `RowBias` (fast path "attention-blocks"): each
block's bias is built inside an activation checkpoint, so no N x T tensor per head is kept for the backward pass."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .inputs import AttentionMask, RowBias, seen_keys

BIAS_BLOCK = 128
"""Queries per block of `chunked_bias_attention`: in single training steps timed at bench speed's small size, 128
was faster than 256 and than 64 for CoPE and FoX (not a committed measurement; docs/SPEED.md has the result)."""


WHOLE_BIAS_LIMIT = 2**28
"""On CUDA without gradients, the most elements (B x H x N x T) a bias may have to be built whole instead."""


def worth_it(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether to attend a block of queries at a time: always while autograd records (it keeps no N x T tensor for
    the backward pass) and on the CPU (a causal block skips the later keys); on CUDA without gradients only where the
    whole bias would exceed `WHOLE_BIAS_LIMIT`, since there it is transient and one kernel call over it beats a call
    per block (prefill of 2,048 tokens through blocks: T5 6.8x and FIRE 11.3x RoPE's on an H200,
    docs/gpu/h200-2026-11-27/)."""
    if torch.is_grad_enabled() or q.device.type != "cuda":
        return True
    return q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] > WHOLE_BIAS_LIMIT


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
        keys = end if mask.segments is not None else seen_keys(valid)  # a host-known causal mask: each sees itself
        rows = AttentionMask(valid[..., :keys], False)

        def block(q_rows, start=start, end=end, rows=rows, keys=keys):
            return attend_rows(q_rows, k[..., :keys, :], v[..., :keys, :], rows, bias.rows(start, end, keys))

        q_rows = q[..., start:end, :]
        blocks.append(checkpoint(block, q_rows, use_reentrant=False) if torch.is_grad_enabled() else block(q_rows))
    return torch.cat(blocks, dim=-2)


__all__ = ["BIAS_BLOCK", "WHOLE_BIAS_LIMIT", "chunked_bias_attention", "worth_it"]
