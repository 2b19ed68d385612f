"""Attention with a value wider than q and k without zero-padding them (fast path "attention-unpadded"), on the CUDA
kernels that take it."""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention


def takes(q: torch.Tensor, v: torch.Tensor) -> bool:
    """CUDA, and a value wider than q and k (else there is no padding to leave out)."""
    return q.device.type == "cuda" and v.shape[-1] > q.shape[-1]


def unpadded_attention(q, k, v, attn_mask, is_causal, scale):
    """A value wider than q and k without padding, on the CUDA kernels that take it: cuDNN or memory-efficient, math
    as the last resort. cuDNN only in a training pass over a sequence's own keys (autograd records, no cached keys):
    PyTorch builds a cuDNN graph for each new shape, so each decoding step, and each step of decoding without a cache
    (one token longer each time), would build one; training repeats its shapes. Grouped KV heads are expanded for the
    kernels."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    backends = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    if k.shape[-2] == q.shape[-2] and torch.is_grad_enabled() and q.requires_grad:
        backends.insert(0, SDPBackend.CUDNN_ATTENTION)
    with sdpa_kernel(backends):
        return scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


__all__ = ["takes", "unpadded_attention"]
