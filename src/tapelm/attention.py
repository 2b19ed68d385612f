"""One attention function for every encoding: PyTorch SDPA, or an explicit-softmax reference path.

The value tensor may be wider than q and k (TAPE's [V | E] stream). SDPA's fast CPU kernel needs q, k and v of one
width and otherwise falls back silently to the slow math kernel, so the narrower side is zero-padded: extra zero
dimensions of q and k leave every logit unchanged (the scale is passed explicitly), extra zero value dimensions are
sliced off. Measured here this costs about 1.7x a V-only call, against 2-3x for a naive concatenation or two calls.
Single-token decoding takes the explicit path instead: one row of logits per head, each cached key and value read
once, no padded copy of the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMask:
    """Which keys each query may see: `valid` (B, 1, N, T) booleans, or None with `is_causal` meaning SDPA's own
    causal mask (no padding, no cache offset) and `is_causal=False` meaning every key."""

    valid: torch.Tensor | None
    is_causal: bool


AttentionFunction = Callable[..., torch.Tensor]
"""What a per-module attention override computes: `fn(q, k, v, mask, bias, scale) -> out`, with the shapes and meaning
of `attend` (q (B, H, N, dq), k (B, Hkv, T, dq), v (B, Hkv, T, dv), an `AttentionMask`, an optional additive bias
(B or 1, H, N, T), the logit scale); returns (B, H, N, dv)."""


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, bias: torch.Tensor | None,
           scale: float, eager: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v with GQA. q (B, H, N, dq), k (B, Hkv, T, dq), v (B, Hkv, T, dv);
    bias (B or 1, H, N, T) needs an explicit `mask.valid`. Returns (B, H, N, dv)."""
    float_mask = _with_bias(mask, bias)
    if eager or q.shape[-2] == 1:
        return explicit_attention(q, k, v, float_mask, mask.is_causal, scale)[0]
    width, value_width = max(q.shape[-1], v.shape[-1]), v.shape[-1]
    q, k, v = (F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask, is_causal=mask.is_causal, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[..., :value_width] if width > value_width else out


def attend_with_probabilities(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
                              bias: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend` through the explicit path, also returning the attention probabilities (B, H, N, T)
    (`output_attentions=True`)."""
    return explicit_attention(q, k, v, _with_bias(mask, bias), mask.is_causal, scale)


def _with_bias(mask: AttentionMask, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The boolean mask, or the float mask that adds `bias` where keys are visible."""
    if bias is None:
        return mask.valid
    return torch.where(mask.valid, bias, float("-inf"))


def explicit_attention(q, k, v, mask, is_causal, scale):
    """The reference path, also used for single-token decoding, where it reads each cached key and value once and
    needs no padding: explicit logits, softmax in float32 or wider, GQA by grouping query heads (no copies of k, v).
    Returns the output (B, H, N, dv) and the probabilities (B, H, N, T), the very tensor the output is computed from
    (so a gradient reaches it, as in transformers' eager attention)."""
    batch, heads, length, _ = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    logits = q.reshape(batch, kv_heads, groups * length, -1) @ k.transpose(-1, -2)
    logits = logits.to(torch.promote_types(q.dtype, torch.float32)).view(batch, kv_heads, groups, length, keys) * scale
    if is_causal:
        mask = torch.ones(length, keys, dtype=torch.bool, device=q.device).tril(keys - length)
    if mask is not None:
        mask = mask.unflatten(1, (kv_heads, groups)) if mask.dim() == 4 and mask.shape[1] == heads else mask.unsqueeze(-3)
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    probs = logits.softmax(dim=-1).to(v.dtype).view(batch, heads, length, keys)
    return (probs.view(batch, kv_heads, groups * length, keys) @ v).view(batch, heads, length, -1), probs
