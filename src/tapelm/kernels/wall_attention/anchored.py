"""Wall attention with one anchor per row (fast path "wall-attention-anchored"), where the gates allow it: when every
row's cumulative log gates span at most `SPAN` in each channel of each head (G at its first key minus G at its last),
exp(G_i - G_j) = exp(G_i - A) exp(A - G_j) with A the middle of that span, so every factor is at most exp(SPAN / 2)
and every product, masked pairs' included, at most exp(SPAN): the logits are one product of the scaled queries and
keys, as plain attention's, and the gradients autograd's. A wider span, a dtype without a `SPAN` or a pass being
compiled (the span is read on the host) is left to the reference (None), which reads distant keys through anchors of
their own chunks (`naive`)."""

from __future__ import annotations

import torch

from ..attention import AttentionMask
from .naive import Gates, mix, times_keys

SPAN = {torch.float32: 60.0, torch.float64: 600.0}
"""The widest span of the cumulative log gates taken, per compute dtype: exp(SPAN) stays far inside its range."""


def wall_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gates: Gates,
    mask: AttentionMask,
    scale: float,
) -> torch.Tensor | None:
    """`naive.wall_attention` of the last N of T tokens with one anchor per row and channel: (B, H, N, dv), or None
    where the gates span too much (see the module)."""
    cumulative, scalar = gates.every, gates.scalar_every
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), cumulative.dtype)
    if dtype not in SPAN or torch.compiler.is_compiling():
        return None
    every = cumulative.detach()  # the anchor is a constant that cancels: no gradient through it
    highest, lowest = every.amax(-2, keepdim=True), every.amin(-2, keepdim=True)
    if float((highest - lowest).max()) > SPAN[dtype]:
        return None
    anchor = ((highest + lowest) / 2).to(dtype)
    length, keys = q.shape[-2], k.shape[-2]
    mine = cumulative[..., keys - length :, :].to(dtype)
    queries = q.to(dtype) * (mine - anchor).exp()
    scaled_keys = times_keys((anchor - cumulative.to(dtype)).exp(), k.to(dtype))
    logits = queries @ scaled_keys.mT * scale
    if scalar is not None:
        logits = logits + (scalar[..., keys - length :, :] - scalar.mT).to(dtype)
    if mask.valid is None:
        valid = torch.ones(length, keys, dtype=torch.bool, device=q.device).tril(keys - length)
    else:
        valid = mask.valid
    return mix(logits.masked_fill(~valid, float("-inf")).softmax(-1), v)


__all__ = ["SPAN", "wall_attention"]
