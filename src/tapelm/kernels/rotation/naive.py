"""The rotation in plain PyTorch, the reference: `rotate_reference` of queries and keys, each by `rotate_halves`."""

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


def halves(angles: torch.Tensor, queries: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) of angles (B or 1, Hkv or 1, N, d) = [a | b], for keys (B, Hkv, N, d) or, with a group axis, for
    queries grouped by KV head (B, Hkv, G, N, d)."""
    a, b = angles.chunk(2, dim=-1)
    return (a[:, :, None], b[:, :, None]) if queries else (a, b)


def rotate_reference(
    q: torch.Tensor, k: torch.Tensor, angles: torch.Tensor, key_angles: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries (B, H, N, d) and keys (B, Hkv, N, d) rotated pairwise by angles (B or 1, Hkv or 1, N, d) = [a | b]
    (one complex number a + i b per pair and KV head; a query head takes its KV head's), the keys by `key_angles`
    where given."""
    kv_heads = k.shape[1]
    grouped = rotate_halves(q.unflatten(1, (kv_heads, -1)), *halves(angles, queries=True))
    return grouped.flatten(1, 2), rotate_halves(k, *halves(angles if key_angles is None else key_angles, False))


def output_like(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """An empty result in x's memory layout: q and k arrive as views of the projections' (B, N, heads, d) output, and
    a rotation in that layout lets attention return its output there too, which the output projection then reads
    without a copy."""
    return torch.empty_like(x, dtype=torch.promote_types(torch.promote_types(x.dtype, a.dtype), b.dtype))


__all__ = ["halves", "output_like", "rotate_halves", "rotate_reference"]
