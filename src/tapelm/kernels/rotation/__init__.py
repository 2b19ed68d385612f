"""Rotating each rotate-half pair (x_i, x_{i+d/2}) of a vector by a complex number (a_i, b_i), the step that RoPE
(a, b = cos, sin) and TAPE (a, b = its compact state) share: (x1 + i x2)(a + i b). The reference (`naive`) and, in
the order they are tried, Triton kernels ("rotation-triton"), fla's rotary kernel ("rotation-fla", RoPE's tables in
passes with gradients) and an autograd function with a hand-written backward ("rotation-autograd"). While compiling
the reference runs: the compiler fuses it itself."""

from __future__ import annotations

import torch

from ...fast_paths import FastPaths
from .. import candidates, first, triton_takes
from .naive import rotate_halves


def _records(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or a.requires_grad or b.requires_grad)


def _triton(x, a, b):
    """Over a sequence (a decoding step's token is not worth a launch). Training under autocast the kernels write q
    and k in autocast's dtype: attention, which they are made for, computes in it, so the float32 result would only
    be cast there (a pass over q and k each way, forward and backward)."""
    if x.shape[-2] == 1 or not (triton_takes(x) and triton_takes(a)):
        return None
    from .triton import rotate_halves_triton, takes

    if not takes(x, a, b):
        return None
    autocast = _records(x, a, b) and torch.is_autocast_enabled(x.device.type)
    return rotate_halves_triton(x, a, b, torch.get_autocast_dtype(x.device.type) if autocast else None)


def _fla(x, a, b):
    from .fla import rotate_halves_fla

    return rotate_halves_fla(x, a, b)


def _autograd(x, a, b):
    """While autograd records the call (a decoding step's few features take longer through an autograd function
    than through the reference's products)."""
    if torch.compiler.is_compiling() or not _records(x, a, b):
        return None
    from .autograd import HalvesRotation

    return HalvesRotation.apply(x, a, b)


CANDIDATES = candidates("rotation", ("triton", _triton), ("fla", _fla), ("autograd", _autograd))


def rotate_pairs(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, paths: FastPaths) -> torch.Tensor:
    """`rotate_halves(x, a, b)` by the first candidate that is on in `paths` and takes the call."""
    out = first(CANDIDATES, paths, x, a, b)
    return rotate_halves(x, a, b) if out is None else out


__all__ = ["CANDIDATES", "rotate_halves", "rotate_pairs"]
