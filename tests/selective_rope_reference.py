"""The attention logits of the Selective RoPE authors' softmax-attention layer, restated plainly for the tests (not
their code, which needs fla's Triton kernels and flash-attn, so runs on no CPU): timurcarstensen/selective-rope,
`selective_rope/modules/rotary.py` (`SelectiveRoPE.forward` on its PyTorch path) and `layers/attn.py` (`Attention`
with `position_embedding.type` "selective_rope", `qk_norm` off as in their configs), one unpadded causal sequence,
as many KV heads as query heads (their layer's only case).

Weights come in the authors' layout and names: `phi_proj` (two bias-free linear maps), `phi_conv1d` (fla's
`ShortConvolution`: a depthwise causal Conv1d without bias, here `F.conv1d` with K - 1 zeros in front), `phi_bias`
(1, 1, H, D/2), `phase_gate_proj` (a linear map, or two), `q_proj`, `k_proj`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2_norm: x / sqrt(sum x^2 + eps) over the last axis."""
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def linear_chain(x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    for weight, bias in layers:
        x = F.linear(x, weight, bias)
    return x


def causal_conv(x: torch.Tensor, weight: torch.Tensor, activation: str | None) -> torch.Tensor:
    """fla's ShortConvolution over x (B, T, F) without a cache: a depthwise causal convolution, then the activation."""
    length, width = x.shape[1], weight.shape[-1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (width - 1, 0)), weight, groups=x.shape[-1])[..., :length].transpose(1, 2)
    return F.silu(y) if activation == "silu" else y


def temperature(head_dim: int, theta: float, temp_max: float, dtype: torch.dtype) -> torch.Tensor:
    """`rotary_temperature("rope", theta, head_dim, temp_max)`: (head_dim / 2,), in `dtype` (theirs: float32)."""
    return temp_max / (theta ** (torch.arange(0, head_dim, 2, dtype=dtype) / head_dim))


def selective_rope_qk(x: torch.Tensor, weights: dict, heads: int, head_dim: int, options: dict):
    """The rotated q and k (B, T, H, D) of their layer for its attention input x (B, T, C)."""
    batch, length, hidden = x.shape
    pairs = head_dim // 2
    q = F.linear(x, weights["q_proj"]).view(batch, length, heads, head_dim)
    k = F.linear(x, weights["k_proj"]).view(batch, length, heads, head_dim)
    normed = l2_norm(x.view(batch, length, heads, hidden // heads)).reshape(batch, length, hidden)
    phi = linear_chain(normed, weights["phi_proj"])
    phi = causal_conv(phi, weights["phi_conv1d"], options.get("conv_act")).view(batch, length, heads, pairs)
    if options.get("use_bias"):
        phi = phi + torch.exp(weights["phi_bias"])
    gate_kind = options.get("gate_parametrization")
    if options.get("use_gate"):
        gate = linear_chain(normed, weights["phase_gate_proj"]).sigmoid()
        phi = phi * (gate.view(batch, length, heads, pairs) if gate_kind == "gla" else gate.unsqueeze(-1))
    angle = temperature(head_dim, options.get("temp_theta", 500000.0), options.get("temp_max", 1.0), x.dtype)
    angle = angle * torch.cumsum(phi, dim=1)
    cos, sin = torch.cos(angle), torch.sin(angle)

    def rotate(t):
        first, second = t[..., :pairs], t[..., pairs:]
        return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)

    return rotate(q), rotate(k)


def selective_rope_logits(x: torch.Tensor, weights: dict, heads: int, head_dim: int, options: dict) -> torch.Tensor:
    """Their pre-softmax logits (B, H, T, T), -inf above the diagonal (flash-attn's causal mask, scale 1/sqrt(D))."""
    q, k = selective_rope_qk(x, weights, heads, head_dim, options)
    logits = q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) / math.sqrt(head_dim)
    length = x.shape[1]
    later = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
    return logits.masked_fill(later, float("-inf"))
