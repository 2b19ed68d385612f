"""Rotating each rotate-half pair (x_i, x_{i+d/2}) of a vector by a complex number (a_i, b_i), the step that RoPE
(a, b = cos, sin) and TAPE (a, b = its compact state) share: (x1 + i x2)(a + i b). The plain PyTorch reference and its
hand-written backward (`naive`), and Triton kernels (`fused`, fast path "triton-rotation": CUDA with Triton, off until
a GPU run passes)."""

from __future__ import annotations

import torch

from ...fast_paths import enabled
from .. import triton_takes
from .naive import HalvesRotation, rotate_halves


def rotate_pairs(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fast_paths: str = "auto") -> torch.Tensor:
    """`rotate_halves`, not while compiling (the compiler fuses the reference itself), else:
    - over a sequence, through the Triton kernels where the fast path "triton-rotation" is on and they take the call
      (CUDA, half or single precision). Training under autocast, they write q and k in autocast's dtype: attention,
      which they are made for, computes in it, so the float32 result would only be cast there (a pass over q and k
      each way, forward and backward);
    - through `HalvesRotation` where "fused-rotation" is on and autograd records the call (a decoding step's few
      features take longer through an autograd function than through the reference's products)."""
    if torch.compiler.is_compiling():
        return rotate_halves(x, a, b)
    records = torch.is_grad_enabled() and (x.requires_grad or a.requires_grad or b.requires_grad)
    if x.shape[-2] > 1 and enabled("triton-rotation", x.device, fast_paths) and triton_takes(x) and triton_takes(a):
        from .fused import rotate_halves_fused, takes

        if takes(x, a, b):
            autocast = records and torch.is_autocast_enabled(x.device.type)
            return rotate_halves_fused(x, a, b, torch.get_autocast_dtype(x.device.type) if autocast else None)
    if records and enabled("fused-rotation", x.device, fast_paths):
        return HalvesRotation.apply(x, a, b)
    return rotate_halves(x, a, b)


__all__ = ["HalvesRotation", "rotate_halves", "rotate_pairs"]
