"""Wall attention in plain PyTorch, the reference: softmax over s_ij = scale sum_n q_in k_jn exp(G_in - G_jn), G the
cumulative per-channel log gates, plus c_i - c_j where a FoX-style scalar gate per head is on (c its cumulative log
gates), a block of queries at a time.

No factor exp(G) or exp(-G) is formed alone (either overflows over a long context); every exponential taken is of a
number at most 0, since G never grows (log gates are at most 0). The keys are cut into chunks of `BLOCK` (counted
from the first key) and each scaled once to its chunk's last key R: k_j exp(R - G_j). A block of queries starts at a
chunk's start (or at the first query) and reads each earlier whole chunk through its first query's A:
exp(G_i - G_j) = exp(G_i - A) exp(A - R) exp(R - G_j); the few earlier keys of its own chunk through
exp(G_i - A) exp(A - G_j), and its own pairs through the difference G_i - G_j. Queries that fit one block (a
decoding step) share no anchors, so they read every earlier key through exp(G_i - A) exp(A - G_j) and no key is
scaled to its chunk. With gradients each block runs inside an activation checkpoint, so no N x T x d tensor per head
is kept."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..attention import AttentionMask

BLOCK = 16
"""Queries per block and keys per chunk: a block's own pairs cost an exponential per channel, its earlier chunks one
product per key (16 was the fastest of 8, 16, 32 and 64 in a training step's attention at bench speed's small
size on the CPU)."""


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
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), cumulative.dtype)
    past = keys - length
    one_block = past // BLOCK * BLOCK + BLOCK >= keys  # a decoding step: no anchors worth sharing
    whole = 0 if one_block else keys // BLOCK * BLOCK  # the keys read through their chunks' anchors
    ends = cumulative[..., BLOCK - 1 : whole : BLOCK, :].to(dtype)  # each chunk's last G
    anchored = times_keys((ends.repeat_interleave(BLOCK, dim=-2) - cumulative[..., :whole, :]).exp(), k[..., :whole, :])
    blocks, start = [], past
    while start < keys:
        end = min(start // BLOCK * BLOCK + BLOCK, keys)
        if mask.valid is None:
            valid = torch.ones(end - start, end, dtype=torch.bool, device=q.device).tril(start)
        else:
            valid = mask.valid[..., start - past : end - past, :end]

        def block(q_rows, k, cumulative, scalar, valid=valid, start=start, end=end):
            logits = _logits(q_rows.to(dtype), k, cumulative.to(dtype), anchored, start, end) * scale
            if scalar is not None:
                logits = logits + (scalar[..., start:end, :] - scalar.mT).to(logits.dtype)
            return logits.masked_fill(~valid, float("-inf")).softmax(-1)

        def output(*args, weights=block, values=v[..., :end, :]):
            return _mix(weights(*args), values)

        rows = slice(None, end)
        args = (q[..., start - past : end - past, :], k[..., rows, :], cumulative[..., rows, :], _part(scalar, rows))
        if probabilities:
            blocks.append(F.pad(block(*args), (0, keys - end)))
        elif torch.is_grad_enabled():
            blocks.append(checkpoint(output, *args, use_reentrant=False))
        else:
            blocks.append(output(*args))
        start = end
    if not probabilities:
        return torch.cat(blocks, dim=-2), None
    weights = torch.cat(blocks, dim=-2)
    return _mix(weights, v), weights


def _per_query_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, Hkv, T, d) repeated for each query head of a KV head: (B, H, T, d)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def times_keys(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """x (B, H, t, d), one per query head, times the keys (B, Hkv, t, d) of each query head's KV head, without
    repeating the keys."""
    return (x.unflatten(1, (k.shape[1], -1)) * k[:, :, None]).flatten(1, 2)


def _mix(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The weights (B, H, n, t) applied to the values (B, Hkv, t, dv), in v's dtype: each KV head's query heads in
    one product, without repeating the values."""
    batch, heads, length, keys = probs.shape
    grouped = probs.reshape(batch, v.shape[1], -1, keys) @ v.to(probs.dtype)
    return grouped.reshape(batch, heads, length, -1).to(v.dtype)


def _part(x: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if x is None else x[..., rows, :]


def _logits(q, k, cumulative, anchored, start: int, end: int) -> torch.Tensor:
    """sum_n q_in k_jn exp(G_in - G_jn) for queries start..end-1 (as key indices) and keys 0..end-1, `anchored` the
    keys of whole chunks scaled to their chunks' last G (the keys before the queries' chunk that it covers are read
    through it, the others directly)."""
    chunk = min(start // BLOCK * BLOCK, anchored.shape[-2])  # the first key read directly
    anchor = cumulative[..., start : start + 1, :]
    mine = cumulative[..., start:end, :]
    near = q * (mine - anchor).exp()
    before = times_keys((anchor - cumulative[..., chunk:start, :]).exp(), k[..., chunk:start, :])
    if chunk:
        ends = cumulative[..., BLOCK - 1 : chunk : BLOCK, :]
        chunks = anchored[..., :chunk, :] * (anchor - ends).exp().repeat_interleave(BLOCK, dim=-2)
        before = torch.cat([chunks, before], dim=-2)
    earlier = near @ before.mT
    causal = torch.ones(end - start, end - start, dtype=torch.bool, device=q.device).tril()[..., None]
    decay = torch.where(causal, mine[..., :, None, :] - mine[..., None, :, :], 0.0).exp()
    own = _per_query_head(k[..., start:end, :], q.shape[1]).to(q.dtype)  # the gates are per query head
    inside = (q[..., :, None, :] * own[..., None, :, :] * decay).sum(-1)
    return torch.cat([earlier, inside], dim=-1)


__all__ = ["BLOCK", "Gates", "times_keys", "wall_attention"]
