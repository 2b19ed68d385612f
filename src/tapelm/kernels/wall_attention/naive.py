"""Wall attention in plain PyTorch, the reference: softmax over s_ij = scale sum_n q_in k_jn exp(G_in - G_jn), G the
cumulative per-channel log gates, plus c_i - c_j where a FoX-style scalar gate per head is on (c its cumulative log
gates), a block of queries at a time.

No factor exp(G) or exp(-G) is formed alone (either overflows over a long context). A block's earlier keys are read
through the block's first query as anchor A: exp(G_i - G_j) = exp(G_i - A) exp(A - G_j), both factors at most 1
since G never grows (log gates are at most 0); the pairs inside the block take the difference G_i - G_j directly.
With gradients each block runs inside an activation checkpoint, so no N x T x d tensor per head is kept."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..attention import AttentionMask

BLOCK = 32
"""Queries per block: the pairs inside a block cost an exponential per channel, the earlier keys one per block."""


class Gates(NamedTuple):
    """A layer's log gates, in float32 or wider: `log` (B, H, N, d) the new tokens', `every` (B, H, T, d) the
    cumulative sums over every key (the new tokens' are its last N rows); the scalar gate's, (B, H, N, 1) and
    (B, H, T, 1), or None."""

    log: torch.Tensor
    every: torch.Tensor
    scalar_log: torch.Tensor | None = None
    scalar_every: torch.Tensor | None = None


def wall_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gates: Gates,
    mask: AttentionMask,
    scale: float,
    probabilities: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Wall attention of the last N of T tokens: q (B, H, N, d), k (B, Hkv, T, d), v (B, Hkv, T, dv), with the
    layer's `gates`; `mask` says which keys each query sees (causal, the queries being the last N keys). Returns the
    output (B, H, N, dv) in v's dtype and, when `probabilities`, the attention weights (B, H, N, T) (else None)."""
    cumulative, scalar = gates.every, gates.scalar_every
    length, keys = q.shape[-2], k.shape[-2]
    groups = q.shape[1] // k.shape[1]
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), cumulative.dtype)
    past = keys - length
    blocks = []
    for start in range(0, length, BLOCK):
        end = min(start + BLOCK, length)
        if mask.valid is None:
            valid = torch.ones(end - start, past + end, dtype=torch.bool, device=q.device).tril(past + start)
        else:
            valid = mask.valid[..., start:end, : past + end]

        def block(q_rows, k, cumulative, scalar, valid=valid, start=past + start, end=past + end):
            logits = _logits(q_rows.to(dtype), k.to(dtype), cumulative.to(dtype), start, end, groups) * scale
            if scalar is not None:
                logits = logits + (scalar[..., start:end, :] - scalar.mT).to(logits.dtype)
            return logits.masked_fill(~valid, float("-inf")).softmax(-1)

        rows = slice(None, past + end)
        args = (q[..., start:end, :], k[..., rows, :], cumulative[..., rows, :], _part(scalar, rows))
        if probabilities:
            blocks.append(F.pad(block(*args), (0, keys - past - end)))
            continue

        def output(*args, weights=block, values=v[..., : past + end, :]):
            return _mix(weights(*args), values)

        grad = torch.is_grad_enabled()
        blocks.append(checkpoint(output, *args, use_reentrant=False) if grad else output(*args))
    if not probabilities:
        return torch.cat(blocks, dim=-2), None
    weights = torch.cat(blocks, dim=-2)
    return _mix(weights, v), weights


def _mix(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The weights (B, H, n, t) applied to the values (B, Hkv, t, dv), in v's dtype."""
    return (probs @ v.repeat_interleave(probs.shape[1] // v.shape[1], dim=1).to(probs.dtype)).to(v.dtype)


def _part(x: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if x is None else x[..., rows, :]


def _logits(q, k, cumulative, start: int, end: int, groups: int) -> torch.Tensor:
    """sum_n q_in k_jn exp(G_in - G_jn) for queries start..end-1 (as key indices) and keys 0..end-1."""
    k = k.repeat_interleave(groups, dim=1)  # the gates are per query head
    anchor = cumulative[..., start : start + 1, :]
    mine = cumulative[..., start:end, :]
    earlier = (q * (mine - anchor).exp()) @ (k[..., :start, :] * (anchor - cumulative[..., :start, :]).exp()).mT
    causal = torch.ones(end - start, end - start, dtype=torch.bool, device=q.device).tril()[..., None]
    decay = torch.where(causal, mine[..., :, None, :] - mine[..., None, :, :], 0.0).exp()
    inside = (q[..., :, None, :] * k[..., None, start:end, :] * decay).sum(-1)
    return torch.cat([earlier, inside], dim=-1)


__all__ = ["BLOCK", "Gates", "wall_attention"]
