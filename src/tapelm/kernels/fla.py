"""FoX and PaTH attention through fla's kernels (flash-linear-attention, fla-org, which maintains both).

tapelm's PyTorch code is the reference (positional/fox.py and positional/path.py with `attention.attend`); this module
maps one forward pass onto fla's calls:

- layouts: tapelm's heads-first (B, H, N, d) to fla's (B, N, H, d) and back;
- FoX's log forget gates per query head, PaTH's unit Householder vectors and strengths per KV head (float32, as fla
  asks), the logit scale;
- the mask: a batch whose mask is causal within contiguous segments of each row (packed documents; padding, each
  padding token a segment of its own, since tapelm's mask lets it see only itself) runs as one row of variable-length
  sequences (`cu_seqlens`); each row one causal sequence runs as it is for FoX, and as one segment a row for PaTH
  (fla 0.6's PaTH kernel without `cu_seqlens` raised an illegal memory access on an H100 at 2 rows of 20 tokens, heads
  of 16, grouped queries: docs/gpu/h100-2026-11-27/).

Cached tokens, a mask of any other shape, head sizes fla's PaTH kernel lacks, or a device without fla leave the call
to the reference (the functions return None). The kernels run on CUDA with fla installed (`pip install tapelm[gpu]`)
where the fast path "fla-kernels" is on (`tapelm.fast_paths`); `operations` is the one place that chooses them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..attention import AttentionMask
from . import fla_takes

PATH_HEAD_SIZES = (16, 32, 64, 128)
"""Head sizes fla's PaTH kernel takes (q, k and v)."""


@dataclass(frozen=True)
class FlaOps:
    """fla's two attention functions, in fla's layouts: `forgetting(q, k, v, g, scale, cu_seqlens)` and
    `path(q, k, v, w, beta, scale, cu_seqlens)`, each returning the output (B, N, H, dv)."""

    forgetting: Callable[..., torch.Tensor]
    path: Callable[..., torch.Tensor]
    path_head_sizes: tuple[int, ...] = PATH_HEAD_SIZES


def operations(x: torch.Tensor) -> FlaOps | None:
    """fla's kernels for tensors like `x`: on CUDA with fla installed, in half or single precision; else None (the
    reference runs)."""
    return _kernels() if fla_takes(x) else None


@functools.cache
def _kernels() -> FlaOps:
    from fla.ops.forgetting_attn import parallel_forgetting_attn
    from fla.ops.path_attn import parallel_path_attn

    def path(q, k, v, w, beta, scale, cu_seqlens):
        return parallel_path_attn(q, k, v, w, beta, scale=scale, cu_seqlens=cu_seqlens)[0]

    def forgetting(q, k, v, g, scale, cu_seqlens):
        return parallel_forgetting_attn(q, k, v, g, scale=scale, cu_seqlens=cu_seqlens)

    return FlaOps(forgetting, path)


def segments(mask: AttentionMask, batch: int, queries: int, keys: int) -> torch.Tensor | None | bool:
    """How the mask cuts the batch into causal sequences: None when every row is one causal sequence; the cumulative
    lengths (int64) of the segments over the B x N tokens laid out as one row, when each token sees exactly the
    earlier tokens of its own contiguous segment; False for any other mask, or when keys are cached."""
    if keys != queries:
        return False
    if mask.valid is None:
        return None if mask.is_causal else False
    valid = mask.valid[:, 0].expand(batch, queries, keys)
    index = torch.arange(queries, device=valid.device)
    first = valid.int().argmax(-1)  # the first key each query sees (B, N)
    causal_run = (index[None, None, :] >= first[..., None]) & (index[None, None, :] <= index[None, :, None])
    starts = first == index
    follows = torch.cat([starts[:, :1], first[:, 1:] == first[:, :-1]], dim=1)  # same segment as the token before
    if not bool(torch.equal(valid, causal_run) and (starts | follows).all()):
        return False
    if bool(starts.sum() == batch):
        return None
    every = starts.flatten().nonzero()[:, 0]
    return torch.cat([every, every.new_tensor([batch * queries])])


def _heads_last(x: torch.Tensor, segmented: bool) -> torch.Tensor:
    """(B, H, N, ...) to fla's (B, N, H, ...), contiguous (the kernels index it so), one row of B x N tokens when the
    batch runs as segments."""
    x = x.transpose(1, 2).contiguous()
    return x.reshape(1, -1, *x.shape[2:]) if segmented else x


def _heads_first(out: torch.Tensor, batch: int) -> torch.Tensor:
    return out.reshape(batch, -1, *out.shape[2:]).transpose(1, 2)


def forgetting_attention(ops: FlaOps, q, k, v, log_gates: torch.Tensor, mask: AttentionMask,
                         scale: float) -> torch.Tensor | None:
    """FoX's attention softmax(q k^T scale + c_i - c_j) v, c the cumulative sum of `log_gates` (B, H, N) along each
    sequence: (B, H, N, dv), or None where fla cannot take the call."""
    cuts = segments(mask, q.shape[0], q.shape[-2], k.shape[-2])
    if cuts is False:
        return None
    segmented = cuts is not None
    out = ops.forgetting(_heads_last(q, segmented), _heads_last(k, segmented), _heads_last(v, segmented),
                         _heads_last(log_gates, segmented).float(), scale, cuts)
    return _heads_first(out, q.shape[0]).to(v.dtype)


def path_attention(ops: FlaOps, q, k, v, w: torch.Tensor, beta: torch.Tensor, mask: AttentionMask,
                   scale: float) -> torch.Tensor | None:
    """PaTH's attention with queries q (B, H, N, d), raw keys k and unit Householder vectors w (B, Hkv, N, d),
    strengths beta (B, Hkv, N): (B, H, N, dv), or None where fla cannot take the call."""
    if q.shape[-1] not in ops.path_head_sizes or v.shape[-1] not in ops.path_head_sizes:
        return None
    cuts = segments(mask, q.shape[0], q.shape[-2], k.shape[-2])
    if cuts is False:
        return None
    if cuts is None:  # each row one sequence: fla 0.6's PaTH kernel without cu_seqlens failed on a GPU
        cuts = torch.arange(0, q.shape[0] * q.shape[-2] + 1, q.shape[-2], device=q.device)
    out = ops.path(_heads_last(q, True), _heads_last(k, True), _heads_last(v, True), _heads_last(w, True).float(),
                   _heads_last(beta, True).float(), scale, cuts)
    return _heads_first(out, q.shape[0]).to(v.dtype)


__all__ = ["FlaOps", "forgetting_attention", "operations", "path_attention", "segments"]
