"""The SwiGLU product through fla's fused kernel (fast path "mlp-fla"), in passes with gradients."""

from __future__ import annotations

import torch

from .. import fla_function


def kernel(x: torch.Tensor):
    """fla's `swiglu` for tensors like `x`, or None where it does not run."""
    return fla_function(x, "fla.modules.activations", "swiglu")


def swiglu_fla(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up, or None where the kernel does not take the call."""
    swiglu = kernel(gate) if torch.is_grad_enabled() else None
    return None if swiglu is None else swiglu(gate, up)


__all__ = ["kernel", "swiglu_fla"]
