"""Wall attention (Tilde Research 2026, in fla 0.6 as `fla.layers.WallAttention`): FoX's forget gate with a separate
decay per query head and channel, no rotation.

Every layer has gates g_t = sigmoid(W x_t + b), one per query head and key channel, x_t the layer's attention input
after the norm (fla's `g_proj` reads the normed hidden states). Query i sees key j through the logit
s_ij = scale sum_n q_in k_jn exp(G_in - G_jn), G the cumulative sum of log g over the tokens, so each channel of the
key decays by the product of the gates after it up to the query; softmax over j as usual. `wall_scalar_gate` adds
FoX's gate (fla's `use_scalar_gate`, off by default as there): one more gate per head and token, whose cumulative log
c adds c_i - c_j to the logits. Initialisation follows fla's: weights normal(initializer_range), biases
`wall_gate_bias_init` (8), so every gate starts near 1 and attention near plain softmax attention.

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
from ..kernels.wall_attention import Gates, wall_attention
from .base import CustomInit, LayerPositional, PerLayerEncoding, PositionContext, check_bool
from .costs import FROM_CPU, estimated


class WallGate(nn.Linear, CustomInit):
    """hidden -> `width` gate logits per query head (head_dim: the decay per channel; 1: the scalar gate); the
    weight starts as any Linear's, the bias at `wall_gate_bias_init`."""

    def __init__(self, config, width: int):
        super().__init__(config.hidden_size, config.num_attention_heads * width, bias=True)
        self.heads, self.bias_init = config.num_attention_heads, float(config.wall_gate_bias_init)

    def init_weights(self, init, std: float) -> None:
        init.constant_(self.bias, self.bias_init)

    def log_gates(self, x: torch.Tensor, ctx: PositionContext) -> torch.Tensor:
        """log g (B, H, N, width) in float32 or wider; 0 at padding tokens."""
        log_g = F.logsigmoid(self(x).to(torch.promote_types(x.dtype, torch.float32)))
        if ctx.token_mask is not None:
            log_g = log_g.masked_fill(~ctx.token_mask[..., None], 0.0)
        return log_g.unflatten(-1, (self.heads, -1)).transpose(1, 2)


def cumulative_gates(gate: WallGate, x, cache, layer_idx: int, name: str, ctx: PositionContext):
    """A gate's log gates for the new tokens and the cumulative sums over every token, stored in the cache as
    `name`."""
    log_g = gate.log_gates(x, ctx)
    cumulative = log_g.cumsum(-2)
    past = last_cached_state(cache, layer_idx, name)
    if past is not None:
        cumulative = cumulative + past
    return log_g, store_state(cache, layer_idx, name, cumulative)


class WallLayer(LayerPositional):
    """One layer's decay gates (and scalar gate) with their cumulative sums in the cache; the layer attends
    itself."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.gate = WallGate(config, config.head_dim)
        self.scalar_gate = WallGate(config, 1) if config.wall_scalar_gate else None
        self._gates = None

    def attention_inputs(self, x, q, k, stream, value_width, cache, layer_idx, valid, ctx):
        """Stores the keys, the value stream and the cumulative log gates, which `attend` reads next."""
        gates = cumulative_gates(self.gate, x, cache, layer_idx, "wall", ctx)
        if self.scalar_gate is not None:
            gates += cumulative_gates(self.scalar_gate, x, cache, layer_idx, "wall scalar", ctx)
        k, stream = store_keys_values(cache, layer_idx, k, stream, value_width)
        self._gates = Gates(*gates)
        return q, k, stream, None

    def attend(self, q, k, stream, shared, mask, scale, ctx, probabilities=False):
        """Wall attention over what `attention_inputs` stored just before (its gates are handed over once)."""
        gates, self._gates = self._gates, None
        return wall_attention(q, k, joined_stream(stream, shared), gates, mask, scale, ctx.paths, probabilities)


class Wall(PerLayerEncoding):
    """Model level: nothing but the per-layer gates. The layers read the cached keys as a sequence (a static cache
    hands over only what is written)."""

    reads_position_limit = False
    display_name = "Wall"
    family = "decaying"
    step_cost = estimated(
        7.26,
        FROM_CPU
        + (
            "its CPU ratio 2.50 (docs/speed/wall-cpu-small/speed-cpu-small.json, commit a84e9fb; 95% interval +-0.69)"
            " times PaTH's GPU-over-CPU ratio 7.05 / 2.427 (the reference path a GPU runs by default works a block of"
            " queries at a time with per-channel work on every query-key pair, as PaTH's reference walks its chunks);"
            " through fla's kernels it should cost about FoX's, unmeasured"
        ),
    )

    fixed_shape_cache = False
    causal_only = True
    softmax_of_logits = False
    layer_class = WallLayer

    @classmethod
    def validate_fields(cls, config) -> None:
        bias = config.wall_gate_bias_init
        if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not math.isfinite(bias):
            raise ValueError(f"wall_gate_bias_init={bias!r} is not allowed; it must be a finite number")
        check_bool("wall_scalar_gate", config.wall_scalar_gate)
