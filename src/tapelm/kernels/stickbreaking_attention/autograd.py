"""Stick-breaking attention as an autograd function with a hand-written backward (fast path
"stickbreaking-attention-autograd"): few passes over the N x T logits and weights, in place, and of them only the
weights kept for the backward pass (the reference's graph keeps several such tensors), which recomputes the logits.

The keys run nearest first (k and v reversed: a short copy), so the sum over the nearer keys is a running sum. With
sp = softplus = -log sigmoid(-.), log sigmoid(z) = z - sp(z) turns the reference's log A into

    log A_ij = z_ij - sum_{l visible, l >= j} sp(z_il),

and a hidden key's z = -inf gives sp = 0 and A = 0 with no mask of its own. With g_ij = A_ij (dout_i . v_j):

    dz_ij = g_ij - sigmoid(z_ij) sum_{j' <= j} g_ij'    (0 at hidden keys, where g = sigmoid(z) = 0),

whose sum over the farther keys is the row's total less a running sum: |g| sums to at most max |dout . v| per row
(the weights sum to at most 1), so the difference loses no more than rounding at that size."""

from __future__ import annotations

import torch
import torch.nn.functional as F

LINEAR_ABOVE = 40.0
"""softplus(z) = z above this (the rest, below e^-40, is under float64's rounding of z)."""


def _weights(q, k, hidden, scale):
    """z and A (B, Hkv, G, N, T), keys nearest first (`k` and `hidden` reversed), in float32 or wider."""
    batch, heads, length, width = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    logits = (q * scale).reshape(batch, kv_heads, heads // kv_heads * length, width) @ k.transpose(-1, -2)
    logits = logits.to(torch.promote_types(q.dtype, torch.float32)).view(batch, kv_heads, -1, length, keys)
    logits.masked_fill_(hidden.unsqueeze(2), float("-inf"))
    weights = F.softplus(logits, threshold=LINEAR_ABOVE).cumsum_(-1)
    return logits, weights.neg_().add_(logits).exp_()


class StickBreakingAttention(torch.autograd.Function):
    """out (B, H, N, F) = A v for q (B, H, N, d), k (B, Hkv, T, d), v (B, Hkv, T, F) and the visible keys
    (B or 1, 1, N, T); A as `naive.stickbreaking_weights` computes it."""

    @staticmethod
    def forward(ctx, q, k, v, visible, scale):
        hidden = ~visible.flip(-1)
        _, weights = _weights(q, k.flip(-2), hidden, scale)
        batch, kv_heads, groups, length, keys = weights.shape
        out = weights.to(v.dtype).view(batch, kv_heads, groups * length, keys) @ v.flip(-2)
        ctx.save_for_backward(q, k, v, hidden, weights)
        ctx.scale = scale
        return out.view(batch, kv_heads * groups, length, -1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, hidden, weights = ctx.saved_tensors
        scale = ctx.scale
        k, v = k.flip(-2), v.flip(-2)
        batch, heads, length, width = q.shape
        kv_heads, keys = k.shape[1], k.shape[2]
        rows = heads // kv_heads * length
        logits = (q * scale).reshape(batch, kv_heads, rows, width) @ k.transpose(-1, -2)
        logits = logits.to(weights.dtype).view_as(weights).masked_fill_(hidden.unsqueeze(2), float("-inf"))
        dout = dout.reshape(batch, kv_heads, rows, -1)
        dv = weights.view(batch, kv_heads, rows, keys).transpose(-1, -2).to(v.dtype) @ dout
        shares = (dout @ v.transpose(-1, -2)).to(weights.dtype).view_as(weights).mul_(weights)  # g
        farther = torch.cumsum(shares, -1)
        total = farther[..., -1:].clone()
        farther.neg_().add_(shares).add_(total)  # total - running sum + g
        dlogits = shares.addcmul_(logits.sigmoid_(), farther, value=-1).view(batch, kv_heads, rows, keys)
        dq = (dlogits.to(q.dtype) @ k).view(batch, heads, length, width) * scale
        dk = (dlogits.transpose(-1, -2).to(k.dtype) @ q.reshape(batch, kv_heads, rows, width)) * scale
        return dq, dk.flip(-2), dv.flip(-2), None, None


__all__ = ["StickBreakingAttention"]
