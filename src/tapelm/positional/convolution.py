"""The short causal convolution over tokens that contextual encodings put in front of their per-token features
(PaTH's Householder vectors, Selective RoPE's phases), as fla's `ShortConvolution` without bias computes it over one
sequence: output_s = sum_o weight[K - 1 - o] * input_{s - o} for o < K, depthwise. Token s reads token s - o only
where the attention mask lets it see that key, so padding and other packed documents bring it no history, and a
cache carries the inputs of the tokens before the new ones."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache import cached_state, store_state


def _diagonal(valid: torch.Tensor, offset: int) -> torch.Tensor:
    """valid[b, s, s + offset] for every query s (B, N); False where that key would lie before the first one."""
    seen = valid.diagonal(offset=offset, dim1=-2, dim2=-1)
    return F.pad(seen, (valid.shape[-2] - seen.shape[-1], 0), value=False)


def short_convolution(
    inputs: torch.Tensor, weight: torch.Tensor, cache, layer_idx: int, valid: torch.Tensor | None
) -> torch.Tensor:
    """`inputs` (B, N, F) of the new tokens convolved with `weight` (F, 1, K) (an `nn.Conv1d` with groups = F), reading
    the inputs of the K - 1 tokens before them from decoder layer `layer_idx`'s cache (state "conv") and storing the
    new ones there. `valid` (B or 1, 1, N, T): the mask; None: every earlier token is read."""
    batch, length, _ = inputs.shape
    history = weight.shape[-1] - 1
    mixed = inputs * weight[:, 0, history]
    if not history:
        return mixed
    past = cached_state(cache, layer_idx, "conv")
    store_state(cache, layer_idx, "conv", inputs[:, None])
    cached = 0 if past is None else past.shape[-2]
    before = inputs.new_zeros(batch, history, inputs.shape[-1])
    if past is not None:
        kept = min(history, cached)
        before[:, history - kept :] = past[:, 0, cached - kept :].to(inputs.dtype)
    sequence = torch.cat([before, inputs], dim=1)
    for offset in range(1, history + 1):
        earlier = sequence[:, history - offset : history - offset + length]  # token s - offset
        if valid is not None:
            earlier = earlier * _diagonal(valid[:, 0], cached - offset)[..., None].to(inputs.dtype)
        mixed = mixed + earlier * weight[:, 0, history - offset]
    return mixed
