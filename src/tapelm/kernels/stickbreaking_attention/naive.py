"""Stick-breaking attention in plain PyTorch, the reference: walking back from each query over the keys it sees, key
j takes the share sigmoid(z_ij) of the stick the nearer keys left, z_ij = scale q_i . k_j. In log space, in float32
or wider:

    log A_ij = log sigmoid(z_ij) + sum_{l visible, l > j} log sigmoid(-z_il)

for the visible keys j (every other weight 0), out_i = sum_j A_ij v_j. The stick a query leaves, 1 - sum_j A_ij, is
dropped. Which keys a query sees is tapelm's mask (padding, packed documents, cached and unwritten static-cache
rows); without `attend_current` a query does not see its own key, the last key its causal mask shows it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import AttentionMask


def visible_keys(mask: AttentionMask, queries: int, keys: int, attend_current: bool, device) -> torch.Tensor:
    """The keys each query's stick is broken over: (B or 1, 1, N, T) booleans from the causal mask, without each
    query's own key (its last visible one) unless `attend_current`."""
    if mask.valid is not None:
        valid = mask.valid
    elif mask.is_causal:
        valid = torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)[None, None]
    else:  # a causal model's queries all after every key (decoding)
        valid = torch.ones(1, 1, queries, keys, dtype=torch.bool, device=device)
    if attend_current:
        return valid
    later = valid.flip(-1).cumsum(-1).flip(-1)  # visible keys at or after each key
    return valid & (later > 1)


def stickbreaking_logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """z (B, Hkv, G, N, T) in float32 or wider for q (B, Hkv * G, N, d) and k (B, Hkv, T, d): GQA by grouping query
    heads, no copies of k."""
    batch, heads, length, width = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    logits = q.reshape(batch, kv_heads, heads // kv_heads * length, width) @ k.transpose(-1, -2)
    return logits.to(torch.promote_types(q.dtype, torch.float32)).view(batch, kv_heads, -1, length, keys) * scale


def stickbreaking_weights(logits: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """A (B, Hkv, G, N, T) from the logits and the visible keys (B or 1, 1, N, T)."""
    visible = visible.unsqueeze(2)
    log_rest = F.logsigmoid(-logits).masked_fill(~visible, 0.0)  # what a hidden key takes: nothing
    later = log_rest.flip(-1).cumsum(-1).flip(-1) - log_rest  # sum over the visible keys after j
    return (F.logsigmoid(logits) + later).masked_fill(~visible, float("-inf")).exp()


def stickbreaking_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, scale: float, attend_current: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output (B, H, N, F) for q (B, H, N, d), k (B, Hkv, T, d), v (B, Hkv, T, F), and the weights
    (B, H, N, T) it mixed v with (in v's dtype, the very tensor the output is computed from)."""
    batch, heads, length, _ = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    visible = visible_keys(mask, length, keys, attend_current, q.device)
    weights = stickbreaking_weights(stickbreaking_logits(q, k, scale), visible)
    weights = weights.to(v.dtype).view(batch, heads, length, keys)
    out = weights.view(batch, kv_heads, -1, keys) @ v
    return out.view(batch, heads, length, -1), weights


__all__ = ["stickbreaking_attention", "stickbreaking_logits", "stickbreaking_weights", "visible_keys"]
