"""The rotation in plain PyTorch, the reference: `rotate_halves`."""

from __future__ import annotations

import torch


def rotate_halves(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x (..., d) rotated pairwise by (a, b) (..., d/2), which broadcast into x's halves."""
    x1, x2 = x.chunk(2, dim=-1)
    y = output_like(x, a, b)
    half = x.shape[-1] // 2
    y[..., :half] = x1 * a - x2 * b
    y[..., half:] = x2 * a + x1 * b
    return y


def output_like(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """An empty result in x's memory layout: q and k arrive as views of the projections' (B, N, heads, d) output, and
    a rotation in that layout lets attention return its output there too, which the output projection then reads
    without a copy."""
    return torch.empty_like(x, dtype=torch.promote_types(torch.promote_types(x.dtype, a.dtype), b.dtype))


__all__ = ["output_like", "rotate_halves"]
