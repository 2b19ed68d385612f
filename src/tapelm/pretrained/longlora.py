"""LongLoRA's shifted sparse attention (S²-Attn, Chen et al. 2023), for training only.

The sequence is cut into groups of `group` tokens and every head attends causally within its group. The second half
of the heads (the last H // 2) uses groups shifted by half a group, so information flows between neighbouring groups
across layers. Unlike the reference implementation, which rolls the sequence so that the first half-group is
appended to the last one (and, under a causal mask, lets those first tokens see the end of the sequence), the
shifted heads here treat the first and last half-groups as two groups of their own: nothing ever sees the future.

Each group is attended as its own batch row (the reshape that makes S²-Attn cheap). Evaluation uses full attention:
`shifted_sparse_attention(model, group)` registers S²-Attn with transformers' `AttentionInterface` and sets it as
that model's `attn_implementation` only inside its `with` block; other models in the process are untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

from ..kernels.attention import padded_attention


def _grouped_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int, scale: float) -> torch.Tensor:
    """Causal attention within consecutive groups; q, k, v (B, h, n, d) with n a multiple of `group`."""
    batch, heads, length, _ = q.shape
    count = length // group

    def split(x: torch.Tensor) -> torch.Tensor:
        return (
            x.view(batch, heads, count, group, x.shape[-1])
            .transpose(1, 2)
            .reshape(batch * count, heads, group, x.shape[-1])
        )

    out = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True, scale=scale)
    return out.view(batch, count, heads, group, -1).transpose(1, 2).reshape(batch, heads, length, -1)


def s2_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int, scale: float) -> torch.Tensor:
    """S²-Attn. q (B, H, N, d), k and v (B, Hkv, N, d) (GQA allowed); N must be a multiple of `group` (even)."""
    batch, heads, length, _ = q.shape
    if group % 2 or length % group:
        raise ValueError(
            f"S²-Attn needs an even group size that divides the sequence length; got group={group}, length={length}"
        )
    repeats = heads // k.shape[1]
    k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    plain = heads - heads // 2
    out_plain = _grouped_causal(q[:, :plain], k[:, :plain], v[:, :plain], group, scale)
    if plain == heads:
        return out_plain
    qs, ks, vs = q[:, plain:], k[:, plain:], v[:, plain:]
    half = group // 2
    parts = []
    if length > group:
        parts.append(_grouped_causal(qs[:, :, half:-half], ks[:, :, half:-half], vs[:, :, half:-half], group, scale))

    # The first and the last half-groups: two groups of their own, attended as one batch.
    def edges(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, :, :half], x[:, :, -half:]], dim=0)

    out_edges = F.scaled_dot_product_attention(edges(qs), edges(ks), edges(vs), is_causal=True, scale=scale)
    first, last = out_edges[:batch], out_edges[batch:]
    out_shifted = torch.cat([first, *parts, last], dim=2)
    return torch.cat([out_plain, out_shifted], dim=1)


def s2_reference_mask(heads: int, length: int, group: int) -> torch.Tensor:
    """The boolean (1, H, N, N) mask S²-Attn amounts to: same (shifted) group and causal. For tests."""
    position = torch.arange(length)
    plain = heads - heads // 2
    masks = []
    for head in range(heads):
        offset = 0 if head < plain else group // 2
        block = (position + offset) // group
        masks.append((block[:, None] == block[None, :]) & (position[None, :] <= position[:, None]))
    return torch.stack(masks)[None]


def attention_function(group: int):
    """S²-Attn as an attention function of transformers' `AttentionInterface`: on causal, unpadded, unbiased,
    uncached batches while the module trains (anything else refused), full attention (tapelm's reference call) while
    it evaluates."""

    def attend(module, query, key, value, attention_mask, scaling: float, is_causal: bool = True, **_):
        if not module.training:
            return padded_attention(query, key, value, attention_mask, is_causal, scaling).transpose(1, 2), None
        if attention_mask is not None or not is_causal or query.shape[2] != key.shape[2]:
            raise ValueError(
                "S²-Attn (LongLoRA) needs causal, unpadded, uncached batches without a logit bias; "
                "it is for training a RoPE model only"
            )
        return s2_attention(query, key, value, group, scaling).transpose(1, 2), None

    return attend


@contextlib.contextmanager
def shifted_sparse_attention(model: torch.nn.Module, group: int) -> Iterator[None]:
    """Inside this block `model` (or the transformers models it wraps, as peft's does) computes S²-Attn with groups
    of `group` tokens while it is in training mode, and full attention in eval mode (evaluations during training);
    on exit each gets back the attention implementation it had."""
    name = f"tapelm_s2_attention_{group}"
    AttentionInterface.register(name, attention_function(group))
    models = [module for module in model.modules() if isinstance(module, PreTrainedModel)]
    previous = [module.config._attn_implementation for module in models]
    for module in models:
        module.set_attn_implementation(name)
    try:
        yield
    finally:
        for module, implementation in zip(models, previous):
            module.set_attn_implementation(implementation)
