"""Stick-breaking attention as an autograd function with a hand-written backward (fast path
"stickbreaking-attention-autograd"): it keeps q, k, v and the visible keys for the backward pass, not the N x T
logits and weights the reference's autograd graph keeps, and recomputes them there.

With g_ij = A_ij (dout_i . v_j), the gradient of the logits follows from log A_ij = log sigmoid(z_ij) +
sum_{l visible, l > j} log sigmoid(-z_il): z_ij enters its own weight's first term and, through the second, the
weight of every visible key before j, so

    dz_ij = g_ij sigmoid(-z_ij) - sigmoid(z_ij) sum_{j' < j} g_ij'    (visible j; 0 elsewhere)."""

from __future__ import annotations

import torch

from .naive import stickbreaking_logits, stickbreaking_weights


class StickBreakingAttention(torch.autograd.Function):
    """out (B, H, N, F) = A v for q (B, H, N, d), k (B, Hkv, T, d), v (B, Hkv, T, F) and the visible keys
    (B or 1, 1, N, T); A as `naive.stickbreaking_weights` computes it."""

    @staticmethod
    def forward(ctx, q, k, v, visible, scale):
        weights = stickbreaking_weights(stickbreaking_logits(q, k, scale), visible)
        batch, kv_heads, groups, length, keys = weights.shape
        out = weights.to(v.dtype).view(batch, kv_heads, groups * length, keys) @ v
        ctx.save_for_backward(q, k, v, visible)
        ctx.scale = scale
        return out.view(batch, kv_heads * groups, length, -1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, visible = ctx.saved_tensors
        scale = ctx.scale
        batch, heads, length, width = q.shape
        kv_heads, keys = k.shape[1], k.shape[2]
        rows = heads // kv_heads * length
        logits = stickbreaking_logits(q, k, scale)
        weights = stickbreaking_weights(logits, visible)
        dout = dout.reshape(batch, kv_heads, rows, -1)
        dv = weights.to(v.dtype).view(batch, kv_heads, rows, keys).transpose(-1, -2) @ dout
        shares = (dout @ v.transpose(-1, -2)).to(weights.dtype).view_as(weights) * weights  # g
        before = shares.cumsum(-1) - shares  # sum over the keys before j
        dlogits = shares * torch.sigmoid(-logits) - torch.sigmoid(logits) * before
        dlogits = dlogits.masked_fill(~visible.unsqueeze(2), 0.0).mul_(scale).view(batch, kv_heads, rows, keys)
        dq = (dlogits.to(q.dtype) @ k).view(batch, heads, length, width)
        dk = dlogits.transpose(-1, -2).to(k.dtype) @ q.reshape(batch, kv_heads, rows, width)
        return dq, dk, dv, None, None


__all__ = ["StickBreakingAttention"]
