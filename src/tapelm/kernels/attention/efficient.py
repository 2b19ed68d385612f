"""Attention with an additive bias that needs a gradient (fast path "attention-efficient": T5's and FIRE's learned
biases, CoPE's, FoX's and PaTH's built from the activations): the bias as SDPA's float mask on CUDA's memory-efficient
kernel, which computes the mask's gradient in its own backward pass, with PyTorch's math kernel as the last resort.
The reference call leaves the choice to SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .inputs import RowBias


def bias_needs_grad(bias) -> bool:
    """Whether autograd will differentiate the bias: a `RowBias` (built from parameters or activations) or a tensor
    that requires a gradient, while gradients are recorded."""
    if bias is None or not torch.is_grad_enabled():
        return False
    return isinstance(bias, RowBias) or bias.requires_grad


def efficient_bias_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, float_mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale + float_mask) v, the mask (B or 1, H, N, T) holding the bias where keys are visible and
    -inf elsewhere. Grouped KV heads are expanded for the kernel (it takes no grouped queries)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask, scale=scale)


__all__ = ["bias_needs_grad", "efficient_bias_attention"]
