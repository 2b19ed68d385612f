"""PaTH's attention through fla's kernel (fast path "path-attention-fla"), within the shapes fla's own tests run
(its tests/ops/test_path_attn.py): heads of 64 or 128, at least 512 tokens in the call, every sequence at least 15
tokens long, always as one row of segments (`cu_seqlens`, batch 1 as fla requires; each row of tapelm's batch, or
each packed document, one segment), w and beta in float32. fla 0.6's kernel raised an illegal memory access outside
them on an H100 and an H200 (2 rows of 20 tokens, heads of 16, grouped queries: docs/gpu/h100-2026-11-27/,
docs/gpu/h200-2026-11-27/). Anything else, cached keys included, leaves the call to the reference (None)."""

from __future__ import annotations

import torch

from .. import fla_function
from ..attention import AttentionMask
from ..fla_layout import heads_first, heads_last, segments, shortest

HEAD_SIZES = (64, 128)
"""Head sizes (q, k and v) fla's PaTH tests run (the kernel asserts 16, 32, 64 or 128)."""
LEAST_TOKENS = 512
"""The fewest tokens in one call that fla's PaTH tests run."""
SHORTEST_SEQUENCE = 15
"""The shortest segment fla's PaTH tests run."""


def kernel(x: torch.Tensor):
    """fla's `parallel_path_attn(q, k, v, w, beta, scale=..., cu_seqlens=...)`, returning the output (and the
    transformed keys, unused here), for tensors like `x`, or None where it does not run."""
    return fla_function(x, "fla.ops.path_attn", "parallel_path_attn")


def takes(q: torch.Tensor, v: torch.Tensor, shortest_sequence: int) -> bool:
    """Whether the call lies within the shapes fla's tests run, its shortest segment `shortest_sequence` tokens long
    (all B x N tokens of q (B, H, N, d) go to fla as one row)."""
    return (
        q.shape[-1] in HEAD_SIZES
        and v.shape[-1] in HEAD_SIZES
        and q.shape[0] * q.shape[-2] >= LEAST_TOKENS
        and shortest_sequence >= SHORTEST_SEQUENCE
    )


def path_attention(
    q: torch.Tensor,
    keys: int,
    raw_keys: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    mask: AttentionMask,
    scale: float,
) -> torch.Tensor | None:
    """PaTH's attention of queries q (B, H, N, d) over raw keys (B, Hkv, N, d) with unit Householder vectors w
    (B, Hkv, N, d) and strengths beta (B, Hkv, N), `keys` the number of keys the attention call holds (more than N
    when some are cached): (B, H, N, dv), or None where the call lies outside fla's tested shapes."""
    run = kernel(q)
    cuts = None if run is None else segments(mask, q.shape[0], q.shape[-2], keys)
    if run is None or cuts is False or not takes(q, v, shortest(mask, cuts, q.shape[-2])):
        return None
    if cuts is None:  # each row one sequence: one segment a row
        cuts = torch.arange(0, q.shape[0] * q.shape[-2] + 1, q.shape[-2], device=q.device)
    out = run(
        heads_last(q, True),
        heads_last(raw_keys, True),
        heads_last(v, True),
        heads_last(w, True).float(),
        heads_last(beta, True).float(),
        scale=scale,
        cu_seqlens=cuts,
    )[0]
    return heads_first(out, q.shape[0]).to(v.dtype)


__all__ = ["HEAD_SIZES", "LEAST_TOKENS", "SHORTEST_SEQUENCE", "kernel", "path_attention", "takes"]
