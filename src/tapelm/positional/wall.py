"""Wall attention (Tilde Research 2026, in fla 0.6 as `fla.layers.WallAttention`): FoX's forget gate with a separate
decay per query head and channel, no rotation.

Every layer has gates g_t = sigmoid(W x_t + b), one per query head and key channel, x_t the layer's attention input
after the norm (fla's `g_proj` reads the normed hidden states). Query i sees key j through the logit
s_ij = scale sum_n q_in k_jn exp(G_in - G_jn), G the cumulative sum of log g over the tokens, so each channel of the
key decays by the product of the gates after it up to the query; softmax over j as usual. Initialisation follows
fla's: weight normal(initializer_range), bias `wall_gate_bias_init` (8), so every gate starts near 1 and attention
near plain softmax attention.

As FoX's, the cumulative sums are computed and cached in float32 (float64 in a float64 model) whatever the model
dtype, beside the layer's keys; padding tokens get log g = 0, and packed documents need no restart (G_i - G_j only
adds the gates between two tokens of one document). The logits are no q.k plus a bias, so the layer computes its
attention itself (`attend`, `tapelm.kernels.wall_attention`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import last_cached_state, store_keys_values, store_state
from ..kernels.attention import joined_stream
from ..kernels.wall_attention import wall_attention
from .base import CustomInit, LayerPositional, PerLayerEncoding, PositionContext


class WallGate(nn.Linear, CustomInit):
    """hidden -> one gate logit per query head and channel; the weight starts as any Linear's, the bias at
    `wall_gate_bias_init`."""

    def __init__(self, config):
        super().__init__(config.hidden_size, config.num_attention_heads * config.head_dim, bias=True)
        self.heads, self.bias_init = config.num_attention_heads, float(config.wall_gate_bias_init)

    def init_weights(self, init, std: float) -> None:
        init.constant_(self.bias, self.bias_init)

    def log_gates(self, x: torch.Tensor, ctx: PositionContext) -> torch.Tensor:
        """log g (B, H, N, d) in float32 or wider; 0 at padding tokens."""
        log_g = F.logsigmoid(self(x).to(torch.promote_types(x.dtype, torch.float32)))
        if ctx.token_mask is not None:
            log_g = log_g.masked_fill(~ctx.token_mask[..., None], 0.0)
        return log_g.unflatten(-1, (self.heads, -1)).transpose(1, 2)


class WallLayer(LayerPositional):
    """One layer's decay gates and their cumulative sums in the cache; the layer attends itself."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.gate = WallGate(config)
        self._gates = None

    def attention_inputs(self, x, q, k, stream, value_width, cache, layer_idx, valid, ctx):
        """Stores the keys, the value stream and the cumulative log gates (B, H, T, d), which `attend` reads next."""
        log_g = self.gate.log_gates(x, ctx)
        cumulative = log_g.cumsum(-2)
        past = last_cached_state(cache, layer_idx, "wall")
        if past is not None:
            cumulative = cumulative + past
        every = store_state(cache, layer_idx, "wall", cumulative)
        k, stream = store_keys_values(cache, layer_idx, k, stream, value_width)
        self._gates = log_g, every
        return q, k, stream, None

    def attend(self, q, k, stream, shared, mask, scale, ctx, probabilities=False):
        """Wall attention over what `attention_inputs` stored just before (its gates are handed over once)."""
        (log_g, every), self._gates = self._gates, None
        return wall_attention(q, k, joined_stream(stream, shared), log_g, every, mask, scale, ctx.paths, probabilities)


class Wall(PerLayerEncoding):
    """Model level: nothing but the per-layer gates. The layers read the cached keys as a sequence (a static cache
    hands over only what is written)."""

    fixed_shape_cache = False
    causal_only = True
    layer_class = WallLayer

    @classmethod
    def validate_fields(cls, config) -> None:
        bias = config.wall_gate_bias_init
        if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not math.isfinite(bias):
            raise ValueError(f"wall_gate_bias_init={bias!r} is not allowed; it must be a finite number")
