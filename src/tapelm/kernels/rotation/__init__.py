"""Rotating the queries and keys of an attention call pairwise, each rotate-half pair (x_i, x_{i+d/2}) by a complex
number a_i + i b_i per KV head and token, the step that RoPE (a, b = cos, sin) and TAPE (a, b = its compact state)
share: (x1 + i x2)(a + i b). The reference (`naive`) and, in the order they are tried, Triton kernels
("rotation-triton": queries and keys in one launch, the angles' gradient written once), fla's rotary kernel
("rotation-fla", RoPE's tables in passes with gradients) and an autograd function with a hand-written backward
("rotation-autograd"). While compiling the reference runs: the compiler fuses it itself."""

from __future__ import annotations

import torch

from ...fast_paths import FastPaths
from .. import candidates, first, triton_takes
from .naive import halves, rotate_halves, rotate_reference


def _records(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors)


def _triton(q, k, angles, key_angles):
    """Over a sequence (a decoding step's token is not worth a launch). Training under autocast the kernels write q
    and k in autocast's dtype: attention, which they are made for, computes in it, so the float32 result would only
    be cast there (a pass over q and k each way, forward and backward)."""
    if k.shape[-2] == 1 or not (triton_takes(q) and triton_takes(angles)):
        return None
    from .triton import rotate_triton, takes

    if not takes(q, k, angles, key_angles):
        return None
    autocast = _records(q, k, angles) and torch.is_autocast_enabled(q.device.type)
    return rotate_triton(q, k, angles, key_angles, torch.get_autocast_dtype(q.device.type) if autocast else None)


def _fla(q, k, angles, key_angles):
    from .fla import rotate_halves_fla

    rotated = [rotate_halves_fla(x, *halves(table, queries=False)) for x, table in ((q, angles), (k, key_angles))]
    return None if None in rotated else tuple(rotated)


def _autograd(q, k, angles, key_angles):
    """While autograd records the call (a decoding step's few features take longer through an autograd function
    than through the reference's products)."""
    if torch.compiler.is_compiling() or not _records(q, k, angles, key_angles):
        return None
    from .autograd import HalvesRotation

    grouped = HalvesRotation.apply(q.unflatten(1, (k.shape[1], -1)), *halves(angles, queries=True))
    return grouped.flatten(1, 2), HalvesRotation.apply(k, *halves(key_angles, queries=False))


CANDIDATES = candidates("rotation", ("triton", _triton), ("fla", _fla), ("autograd", _autograd))


def rotate_queries_and_keys(
    q: torch.Tensor, k: torch.Tensor, angles: torch.Tensor, paths: FastPaths, key_angles: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotate_reference(q, k, angles, key_angles)` by the first candidate that is on in `paths` and takes the
    call."""
    key_angles = angles if key_angles is None else key_angles
    out = first(CANDIDATES, paths, q, k, angles, key_angles)
    return rotate_reference(q, k, angles, key_angles) if out is None else out


__all__ = ["CANDIDATES", "rotate_halves", "rotate_queries_and_keys", "rotate_reference"]
