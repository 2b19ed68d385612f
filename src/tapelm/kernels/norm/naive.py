"""The reference RMSNorm: transformers' `LlamaRMSNorm.forward`, as a function of the input, weight and epsilon."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) computed in float32 and cast back to x's dtype, times `weight` (bit for bit transformers')."""
    wide = x.to(torch.float32)
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * wide.to(x.dtype)


__all__ = ["rms_norm"]
