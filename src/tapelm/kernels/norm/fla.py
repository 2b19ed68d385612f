"""RMSNorm through fla's fused kernel (fast path "norm-fla"), in passes with gradients (training; without them,
in prefill and decoding, the reference was faster on an H100: docs/gpu/h100-2026-11-26-b/)."""

from __future__ import annotations

import torch

from .. import fla_function


def kernel(x: torch.Tensor):
    """fla's `rms_norm` for tensors like `x`, or None where it does not run."""
    return fla_function(x, "fla.modules.norm.layernorm", "rms_norm")


def rms_norm_fla(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """`naive.rms_norm(x, weight, eps)`, or None where the kernel does not take the call."""
    rms_norm = kernel(x) if torch.is_grad_enabled() else None
    return None if rms_norm is None else rms_norm(x, weight, None, eps=eps)


__all__ = ["kernel", "rms_norm_fla"]
