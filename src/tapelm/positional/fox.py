"""FoX, the Forgetting Transformer (Lin, Nikishin, He, Courville 2025, "Forgetting Transformer: Softmax Attention
with a Forget Gate"): a data-dependent ALiBi, no rotation.

Every layer has a forget gate per query head and token, f_t = sigmoid(w . x_t + b), where x_t is the layer's attention
input after the norm (as the reference zhixuan-lin/forgetting-transformer: `fgate_proj` reads the normed hidden
states). Query i sees key j with the additive logit bias sum_{s=j+1..i} log f_s = c_i - c_j, c the cumulative sum of
log f. Initialisation follows the reference's data-dependent ("full") gate: weight normal(initializer_range), bias 0
(`fox_gate_bias_init`), so f starts near 1/2.

The cumulative sums are computed and cached in float32 (float64 in a float64 model) whatever the model dtype, one
value per head and token beside the layer's keys in its cache layer; padding tokens get log f = 0, so a left-padded
sequence computes what it computes alone. Packed documents need no restart of the sums: c_i - c_j only adds the
gates between two tokens of one document (the mask hides every other pair). As in the reference, c_i - c_j is a
difference of two running sums: over very long contexts float32 keeps about 1e-7 of |c| as absolute error in the
bias.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import last_cached_state, store_keys_values, store_state
from ..kernels.forgetting_attention import forgetting_attention_bias
from .base import CustomInit, LayerPositional, PerLayerEncoding, PositionContext
from .costs import measured


class ForgetGate(nn.Linear, CustomInit):
    """hidden -> one gate logit per head; the weight starts as any Linear's, the bias at `fox_gate_bias_init`."""

    def __init__(self, config):
        super().__init__(config.hidden_size, config.num_attention_heads, bias=True)
        self.bias_init = float(config.fox_gate_bias_init)

    def init_weights(self, init, std: float) -> None:
        init.constant_(self.bias, self.bias_init)


class FoXLayer(LayerPositional):
    """One layer's forget gate (hidden -> heads, with bias) and its cumulative log gates in the cache."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.gate = ForgetGate(config)

    def log_forget(self, x: torch.Tensor, ctx: PositionContext) -> torch.Tensor:
        """log f (B, H, N) in float32 or wider; 0 at padding tokens."""
        log_f = F.logsigmoid(self.gate(x).to(torch.promote_types(x.dtype, torch.float32)))
        if ctx.token_mask is not None:
            log_f = log_f.masked_fill(~ctx.token_mask[..., None], 0.0)
        return log_f.transpose(1, 2)

    def attention_inputs(self, x, q, k, stream, value_width, cache, layer_idx, valid, ctx):
        log_f = self.log_forget(x, ctx)
        cumulative = log_f.cumsum(-1)[..., None]  # (B, H, N, 1)
        past = last_cached_state(cache, layer_idx, "forget")
        if past is not None:
            cumulative = cumulative + past
        every = store_state(cache, layer_idx, "forget", cumulative)  # (B, H, T, 1)
        k, stream = store_keys_values(cache, layer_idx, k, stream, value_width)
        every = every.transpose(-1, -2)  # c_i - c_j = sum_{s=j+1..i} log f_s
        return q, k, stream, forgetting_attention_bias(log_f, cumulative, every, q.dtype)


class FoX(PerLayerEncoding):
    """Model level: nothing but the per-layer gates; the bias needs an explicit float mask."""

    reads_position_limit = False
    display_name = "FoX"
    family = "decaying"
    step_cost = measured(1.65)

    adds_logit_bias = True
    causal_only = True
    layer_class = FoXLayer

    @classmethod
    def validate_fields(cls, config) -> None:
        bias = config.fox_gate_bias_init
        if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not math.isfinite(bias):
            raise ValueError(f"fox_gate_bias_init={bias!r} is not allowed; it must be a finite number")
