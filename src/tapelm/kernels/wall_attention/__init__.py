"""Wall attention, softmax over s_ij = scale sum_n q_in k_jn exp(G_in - G_jn) with G the cumulative per-channel log
gates (and a FoX-style scalar gate per head where it is on): the reference (`naive`), fla's kernels
("wall-attention-fla": its parallel kernel for a pass without cached keys, its decode kernel for cached ones) and one
product of anchored queries and keys where the gates span little enough ("wall-attention-anchored")."""

from __future__ import annotations

import torch

from ...fast_paths import FastPaths
from .. import candidates, first
from ..attention import AttentionMask
from .naive import BLOCK, Gates
from .naive import wall_attention as naive_wall_attention


def _fla(q, k, v, gates, mask, scale, paths):
    from .fla import wall_attention

    return wall_attention(q, k, v, gates, mask, scale)


def _anchored(q, k, v, gates, mask, scale, paths):
    from .anchored import wall_attention

    return wall_attention(q, k, v, gates, mask, scale, paths)


CANDIDATES = candidates("wall-attention", ("fla", _fla), ("anchored", _anchored))


def wall_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gates: Gates,
    mask: AttentionMask,
    scale: float,
    paths: FastPaths,
    probabilities: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Wall attention of the last N of T tokens (`naive.wall_attention`): the first candidate that is on and takes
    the call, else the reference. Weights (`probabilities`) come from the reference only."""
    if not probabilities:
        out = first(CANDIDATES, paths, q, k, v, gates, mask, scale, paths)
        if out is not None:
            return out, None
    return naive_wall_attention(q, k, v, gates, mask, scale, probabilities)


__all__ = ["BLOCK", "CANDIDATES", "Gates", "naive_wall_attention", "wall_attention"]
