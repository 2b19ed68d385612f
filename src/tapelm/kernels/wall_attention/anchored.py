"""Wall attention with one anchor per row (fast path "wall-attention-anchored"), where the gates allow it: when every
row's cumulative log gates span at most `SPAN` in each channel of each head (G at its first key minus G at its last),
exp(G_i - G_j) = exp(G_i - A) exp(A - G_j) with A the middle of that span, so every factor is at most exp(SPAN / 2)
and every product, masked pairs' included, at most exp(SPAN): the logits are those of plain attention between queries
and keys scaled by their factors (the scalar gate's c_i - c_j a bias, as FoX's), so the decoder's attention function
computes it with its own fast paths (SDPA's CPU flash kernel without the scalar gate), and autograd the gradients. A
wider span, a dtype without a `SPAN` or a pass being compiled (the span is read on the host) is left to the reference
(None), which reads distant keys through anchors of their own chunks (`naive`)."""

from __future__ import annotations

import torch

from ...fast_paths import FastPaths
from ..attention import AttentionMask, attend
from .naive import Gates, times_keys

SPAN = {torch.float32: 60.0, torch.float64: 600.0}
"""The widest span of the cumulative log gates taken, per compute dtype: exp(SPAN) stays far inside its range."""


def wall_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gates: Gates,
    mask: AttentionMask,
    scale: float,
    paths: FastPaths,
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
    queries = q.to(dtype) * (cumulative[..., keys - length :, :].to(dtype) - anchor).exp()
    scaled_keys = times_keys((anchor - cumulative.to(dtype)).exp(), k.to(dtype))  # per query head, as the gates
    values = v.to(dtype).repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    bias = None if scalar is None else (scalar[..., keys - length :, :] - scalar.mT).to(dtype)
    if mask.valid is None and (bias is not None or length != keys):  # the causal mask, explicit
        valid = torch.ones(length, keys, dtype=torch.bool, device=q.device).tril(keys - length)
        mask = AttentionMask(valid[None, None], False)
    return attend(queries, scaled_keys, values, mask, bias, scale, paths).to(v.dtype)


__all__ = ["SPAN", "wall_attention"]
