"""Wall attention through fla's kernels (fast path "wall-attention-fla"): tapelm's heads-first layout to fla's
token-major one and back, the log gates per query head and channel in float32 (fla's `g`, natural logarithms, which
fla sums itself; the scalar gate's as its `g_scalar`). A pass without cached keys runs `parallel_wall_attn`, the mask
as fla's variable-length segments (packed documents; padding, each padding token a segment of its own). Cached keys
run fla's decode kernel over keys rescaled per chunk of `CHUNK` (rebuilt from tapelm's cache at each call, from the
cumulative sums tapelm keeps), only without gradients, where every query sees every earlier key (the decode
kernel takes no mask: a padded batch goes to the reference) and where the rescaled keys are finite (k_j 2^(R - P_j)
grows with the decay over a chunk, past float32's range for gates closed enough). Any other call is left to the
reference (None)."""

from __future__ import annotations

import math

import torch

from .. import fla_function
from ..attention import AttentionMask
from ..fla_layout import heads_first, heads_last, segments
from .naive import Gates

CHUNK = 64
"""Keys per anchor of the decode kernel's rescaled keys (fla's `WALL_DECODE_CHUNK`)."""


def kernel(x: torch.Tensor, name: str = "parallel_wall_attn"):
    """fla's `name` in `fla.ops.wall_attn` for tensors like `x`, or None where it does not run."""
    return fla_function(x, "fla.ops.wall_attn", name)


def wall_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gates: Gates,
    mask: AttentionMask,
    scale: float,
) -> torch.Tensor | None:
    """`naive.wall_attention` through fla: (B, H, N, dv), or None where fla does not take the call."""
    if k.shape[-2] != q.shape[-2]:
        return _decode(q, k, v, gates, mask, scale)
    run = kernel(q)
    cuts = None if run is None else segments(mask, q.shape[0], q.shape[-2], k.shape[-2])
    if run is None or cuts is False:
        return None
    segmented = cuts is not None
    out = run(
        heads_last(q, segmented),
        heads_last(k, segmented),
        heads_last(v, segmented),
        heads_last(gates.log, segmented).float(),
        g_scalar=None if gates.scalar_log is None else heads_last(gates.scalar_log[..., 0], segmented).float(),
        scale=scale,
        cu_seqlens=cuts,
    )
    return heads_first(out, q.shape[0]).to(v.dtype)


def _decode(q, k, v, gates: Gates, mask, scale) -> torch.Tensor | None:
    """The last N queries over T cached keys through fla's decode kernel, or None."""
    run = kernel(q, "parallel_wall_attn_decode")
    if run is None or (torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, *gates))):
        return None
    length, keys = q.shape[-2], k.shape[-2]
    if mask.valid is not None:
        causal = torch.ones(length, keys, dtype=torch.bool, device=q.device).tril(keys - length)
        if not torch.equal(mask.valid, causal.expand_as(mask.valid)):
            return None
    build = kernel(q, "build_wall_kv_cache")
    prefix = heads_last(gates.every, False).float() / math.log(2)  # fla's prefix sums are in base 2
    rescaled, anchors = build(heads_last(k, False), prefix, CHUNK, out_dtype=k.dtype)
    if not bool(torch.isfinite(rescaled).all()):  # a chunk's gates past float32's range: the reference is exact
        return None
    scalar = None if gates.scalar_every is None else heads_last(gates.scalar_every[..., 0], False).float() / math.log(2)
    out, _ = run(
        heads_last(q, False),
        heads_last(v, False),
        prefix[:, -length:].contiguous(),
        rescaled,
        anchors,
        None,
        scale,
        CHUNK,
        g_scalar_cumsum=scalar,
    )
    return heads_first(out, q.shape[0]).to(v.dtype)


__all__ = ["CHUNK", "kernel", "wall_attention"]
