"""FoX's attention through fla's kernel (fast path "forgetting-attention-fla"): tapelm's heads-first layout to fla's
token-major one and back, the log forget gates per query head in float32 (as fla asks), and the mask as fla's
variable-length segments (packed documents; padding, each padding token a segment of its own, since tapelm's mask
lets it see only itself). Cached keys, or a mask of any other shape, leave the call to the reference (None)."""

from __future__ import annotations

import torch

from .. import fla_function
from ..attention import AttentionMask
from ..fla_layout import heads_first, heads_last, segments


def kernel(x: torch.Tensor):
    """fla's `parallel_forgetting_attn(q, k, v, g, scale=..., cu_seqlens=...)` (in its layouts) for tensors like `x`,
    or None where it does not run."""
    return fla_function(x, "fla.ops.forgetting_attn", "parallel_forgetting_attn")


def forgetting_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_gates: torch.Tensor, mask: AttentionMask, scale: float
) -> torch.Tensor | None:
    """softmax(q k^T scale + c_i - c_j) v, c the cumulative sum of `log_gates` (B, H, N) along each sequence:
    (B, H, N, dv), or None where fla cannot take the call."""
    run = kernel(q)
    cuts = None if run is None else segments(mask, q.shape[0], q.shape[-2], k.shape[-2])
    if run is None or cuts is False:
        return None
    segmented = cuts is not None
    out = run(
        heads_last(q, segmented),
        heads_last(k, segmented),
        heads_last(v, segmented),
        heads_last(log_gates, segmented).float(),
        scale=scale,
        cu_seqlens=cuts,
    )
    return heads_first(out, q.shape[0]).to(v.dtype)


__all__ = ["forgetting_attention", "kernel"]
