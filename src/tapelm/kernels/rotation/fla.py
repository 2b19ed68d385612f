"""RoPE's rotation through fla's rotary kernel (fast path "rotation-fla"), in passes with gradients (training; without
them, in prefill and decoding, the reference was faster on an H100: docs/gpu/h100-2026-11-26-b/): x (B, H, N, d)
rotated by per-token tables (B or 1, 1, N, d/2) that need no gradient. fla's kernel reads a table row per position,
offset per sequence: sequence b's rows start at b * N of the flattened tables, so any positions (packing, RandPE,
left padding) rotate as in the reference."""

from __future__ import annotations

import torch

from .. import fla_function


def kernel(x: torch.Tensor):
    """fla's `rotary_embedding` for tensors like `x`, or None where it does not run."""
    return fla_function(x, "fla.modules.rotary", "rotary_embedding")


def takes(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether fla's kernel computes this call: x (B, H, N, d), one table per token shared by the heads, no gradient
    for the tables."""
    return (
        x.dim() == 4
        and a.dim() == 4
        and a.shape == b.shape
        and a.shape[1] == 1
        and a.shape[0] in (1, x.shape[0])
        and a.shape[2:] == (x.shape[2], x.shape[3] // 2)
        and not (a.requires_grad or b.requires_grad)
    )


def rotate_halves_fla(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """`rotate_halves(x, a, b)`, or None where the kernel does not take the call."""
    rotary_embedding = kernel(x) if torch.is_grad_enabled() else None
    if rotary_embedding is None or not takes(x, a, b):
        return None
    batch, _, length, dim = x.shape

    def rows(table):
        return table.expand(batch, 1, length, dim // 2).reshape(batch * length, -1).to(x.dtype)

    offsets = torch.arange(batch, device=x.device) * length
    return rotary_embedding(x.transpose(1, 2), rows(a), rows(b), seqlen_offsets=offsets).transpose(1, 2)


__all__ = ["kernel", "rotate_halves_fla", "takes"]
