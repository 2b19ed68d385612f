"""Stick-breaking attention through fla's kernel (fast path "stickbreaking-attention-fla"): tapelm's heads-first layout
to fla's token-major one and back, and the mask as fla's variable-length segments (packed documents; padding, each
padding token a segment of its own, which tapelm's mask lets see only itself). Cached keys, a mask of any other
shape, or q, k or v wider than fla's 256 leave the call to the reference (None)."""

from __future__ import annotations

import torch

from .. import fla_function
from ..attention import AttentionMask
from ..fla_layout import heads_first, heads_last, segments

WIDEST = 256
"""The widest q, k and v fla's kernel takes."""


def kernel(x: torch.Tensor):
    """fla's `parallel_stickbreaking_attn(q, k, v, scale=..., attend_current=..., cu_seqlens=...)` (in its layouts)
    for tensors like `x`, or None where it does not run."""
    return fla_function(x, "fla.ops.stickbreaking_attn", "parallel_stickbreaking_attn")


def stickbreaking_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, scale: float, attend_current: bool
) -> torch.Tensor | None:
    """The output (B, H, N, F) of `naive.stickbreaking_attention`, or None where fla cannot take the call."""
    run = kernel(q)
    if run is None or max(q.shape[-1], v.shape[-1]) > WIDEST:
        return None
    cuts = segments(mask, q.shape[0], q.shape[-2], k.shape[-2])
    if cuts is False:
        return None
    segmented = cuts is not None
    out, _ = run(
        heads_last(q, segmented),
        heads_last(k, segmented),
        heads_last(v, segmented),
        scale=scale,
        attend_current=attend_current,
        cu_seqlens=cuts,
    )
    return heads_first(out, q.shape[0]).to(v.dtype)


__all__ = ["stickbreaking_attention", "kernel"]
