"""The reference attention: one SDPA call with q and k zero-padded to the value's width (extra zero dimensions leave
every logit unchanged; the scale is passed explicitly), and the explicit-softmax path (single-token decoding,
`attn_implementation="eager"`, `output_attentions=True`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def padded_attention(q, k, v, attn_mask, is_causal, scale):
    """The reference SDPA call: the narrower of q/k and v zero-padded to one width, the padding sliced off. Padded in
    the dtype SDPA computes in (under autocast, after the cast it would make itself: the same numbers, half the bytes
    of padding float32 tensors, forward and backward)."""
    width, value_width = max(q.shape[-1], v.shape[-1]), v.shape[-1]
    if width > min(q.shape[-1], v.shape[-1]):
        dtype = sdpa_dtype(q, k, v)
        q, k, v = (F.pad(x.to(dtype), (0, width - x.shape[-1])) if x.shape[-1] < width else x for x in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out[..., :value_width] if width > value_width else out


def sdpa_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype SDPA computes in for these inputs: autocast's when it is on for their device (as SDPA itself is cast
    under autocast), else their common dtype."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    dtype = tensors[0].dtype
    for tensor in tensors[1:]:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


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
        mask = (
            mask.unflatten(1, (kv_heads, groups)) if mask.dim() == 4 and mask.shape[1] == heads else mask.unsqueeze(-3)
        )
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    probs = logits.softmax(dim=-1).to(v.dtype).view(batch, heads, length, keys)
    return (probs.view(batch, kv_heads, groups * length, keys) @ v).view(batch, heads, length, -1), probs


__all__ = ["explicit_attention", "padded_attention", "sdpa_dtype"]
