"""GRAPE's multiplicative encodings (Zhang et al. 2025, "Group Representational Position Encoding", arXiv 2512.07805;
conventions read from the authors' model-architectures/GRAPE, model/llama-mha-grape-m-nonctx.py and
llama-mha-grape-m-ctx.py, not copied): q and k rotated on RoPE's canonical planes (transformers' rotate-half pairing)
by the angle phase_t * theta_j, with learnable per-plane frequencies theta_j in every layer, initialised to RoPE's
spectrum, one set for all heads (`grape_share_across_heads`) or one per KV head.

- "grape-m-fixed" (non-contextual): the phase is the token's position; theta = exp(log_freq / s), log_freq starting
  at s log(RoPE's frequency), s = `grape_log_freq_scale` (a learning-rate scaling; `Spectrum` stores log_freq less
  that constant).
- "grape-m" (contextual, the authors' Type-I): the phase is Phi_t = sum_{tau < t} omega_tau, an exclusive running
  sum of increments omega_t = sigmoid((w . x_t + b) / `grape_ctx_omega_scale`), x_t the layer's attention input after
  the norm, one per token or per KV head (`grape_ctx_per_head`); theta = exp(log_freq) (s = 1). Query i sees key j
  through the rotation by (Phi_i - Phi_j) theta alone. w starts at 0, b at log(expm1(`grape_ctx_init_omega`)).

Direction: tapelm rotates as RoPE does, (x1 + i x2) e^{i phase theta}; the authors' code rotates by e^{-i phase theta}
(RoPE of negated positions). The two give the same logits once the second half of every q and k head is negated, a
fixed orthogonal change of the projections (tests/grape_reference.py holds tapelm to the authors' computation so).

Cache: "grape-m-fixed" caches rotated keys as RoPE does. "grape-m" also caches each token's inclusive running phase,
so a continuation starts from the last one. Padding tokens add no phase, so left padding computes what the sequence
computes alone; packed documents need no restart, since only phase differences inside a document reach the logits.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..cache import last_cached_state, store_keys_values, store_state
from ..kernels.rotation import rotate_queries_and_keys
from .base import CustomInit, LayerPositional, PerLayerEncoding, PositionContext, check_bool, check_positive_number
from .costs import FROM_CPU, estimated
from .rotary import rope_frequencies


class Spectrum(CustomInit):
    """Per-plane frequencies theta = rope * exp(shift / scale) ((d/2,) shared, or (Hkv, d/2)), learnable or frozen:
    `rope` RoPE's frequencies from `rope_theta` (`rope_frequencies`), and `shift` starting at 0,
    so that a fresh layer rotates exactly as RoPE. The authors store log_freq = scale * log(theta) instead, which is
    shift plus a constant: the same function and gradients (weight decay, where a training loop applies it to these
    parameters, pulls toward RoPE's spectrum here, toward theta = 1 there). `table(phase)` turns phases into a
    rotation table [cos | sin]."""

    def __init__(self, config, scale: float):
        super().__init__()
        self.scale = float(scale)
        self.theta = float(config.rope_parameters["rope_theta"])
        self.head_dim = config.head_dim
        shape = (
            (config.head_dim // 2,)
            if config.grape_share_across_heads
            else (config.num_key_value_heads, config.head_dim // 2)
        )
        self.log_freq_shift = nn.Parameter(torch.zeros(shape), requires_grad=config.grape_learnable_freq)

    def init_weights(self, init, std: float) -> None:
        init.zeros_(self.log_freq_shift)

    def frequencies(self, dtype: torch.dtype) -> torch.Tensor:
        """theta (1 or Hkv, d/2) in `dtype`."""
        shift = self.log_freq_shift.to(dtype)
        rope = rope_frequencies(self.theta, self.head_dim, shift.device).to(dtype)
        return (rope * (shift / self.scale).exp()).view(-1, self.head_dim // 2)

    def table(self, phase: torch.Tensor) -> torch.Tensor:
        """Phases (B, 1 or Hkv, N) -> the rotation table [cos | sin] (B, 1 or Hkv, N, head_dim), the angles computed
        in float32 (float64 in a float64 model), in the parameters' dtype (as RoPE's table is in the model's)."""
        wide = torch.promote_types(self.log_freq_shift.dtype, torch.float32)
        angles = phase.to(wide)[..., None] * self.frequencies(wide)[:, None, :]
        return torch.cat([angles.cos(), angles.sin()], dim=-1).to(self.log_freq_shift.dtype)


class GrapeFixedLayer(LayerPositional):
    """One layer's frequencies; q and k rotated by position x theta."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.spectrum = Spectrum(config, config.grape_log_freq_scale)

    def transform_qk(self, q, k, state, ctx: PositionContext):
        positions = ctx.query_positions[:1] if ctx.query_positions.stride(0) == 0 else ctx.query_positions
        table = self.spectrum.table(positions[:, None])
        return rotate_queries_and_keys(q, k, table, ctx.paths)


class Increment(nn.Linear, CustomInit):
    """hidden -> one increment logit per token (or per KV head): weight 0, bias log(expm1(grape_ctx_init_omega))."""

    def __init__(self, config):
        super().__init__(config.hidden_size, config.num_key_value_heads if config.grape_ctx_per_head else 1)
        self.bias_init = math.log(math.expm1(config.grape_ctx_init_omega))

    def init_weights(self, init, std: float) -> None:
        init.zeros_(self.weight)
        init.constant_(self.bias, self.bias_init)


class GrapeContextualLayer(LayerPositional):
    """One layer's increments and frequencies; its cache keeps each token's running phase."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.spectrum = Spectrum(config, 1.0)
        self.increment = Increment(config)
        self.omega_scale = float(config.grape_ctx_omega_scale)

    def increments(self, x: torch.Tensor, ctx: PositionContext) -> torch.Tensor:
        """omega (B, 1 or Hkv, N) in float32 or wider; 0 at padding tokens."""
        wide = torch.promote_types(x.dtype, torch.float32)
        omega = torch.sigmoid(self.increment(x).to(wide) / self.omega_scale)
        if ctx.token_mask is not None:
            omega = omega * ctx.token_mask[..., None]
        return omega.transpose(1, 2)

    def attention_inputs(self, x, q, k, stream, value_width, cache, layer_idx, valid, ctx):
        omega = self.increments(x, ctx)
        running = omega.cumsum(-1)[..., None]  # sum_{tau <= t} omega_tau, (B, S, N, 1)
        past = last_cached_state(cache, layer_idx, "phase")
        if past is not None:
            running = running + past
        store_state(cache, layer_idx, "phase", running)
        table = self.spectrum.table(running[..., 0] - omega)  # Phi_t: the exclusive sum
        q, k = rotate_queries_and_keys(q, k, table, ctx.paths)
        k, stream = store_keys_values(cache, layer_idx, k, stream, value_width)
        return q, k, stream, None


class GrapeM(PerLayerEncoding):
    """Both GRAPE-M encodings: q and k rotated on RoPE's planes by learnable per-plane frequencies (`Spectrum`)."""

    reads_position_limit = False

    @classmethod
    def validate_fields(cls, config) -> None:
        check_bool("grape_learnable_freq", config.grape_learnable_freq)
        check_bool("grape_share_across_heads", config.grape_share_across_heads)

    @classmethod
    def validate_config(cls, config) -> None:
        if config.head_dim % 2:
            raise ValueError(
                f"head_dim={config.head_dim} must be even for pe_type={config.pe_type!r} (planar rotations)"
            )
        rope_type = (config.rope_parameters or {}).get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(
                f"rope_parameters rope_type={rope_type!r} is not allowed with pe_type={config.pe_type!r}: "
                "its frequencies start at the default RoPE spectrum (rope_theta only)"
            )


class GrapeFixed(GrapeM):
    """Non-contextual GRAPE-M: RoPE with learnable frequencies in every layer."""

    display_name = "GRAPE-M-fixed"
    step_cost = estimated(
        1.35,
        FROM_CPU
        + (
            "1.085 x TAPE's 1.36 / 1.094 (q and k rotated by per-token tables through tapelm.kernels.rotation, as "
            "TAPE; FoX's factor, 1.65 / 1.329, is the same); docs/speed/grape-cpu-small/speed-cpu-small.json, commit "
            "84fe1cb"
        ),
    )

    layer_class = GrapeFixedLayer

    @classmethod
    def validate_fields(cls, config) -> None:
        super().validate_fields(config)
        check_positive_number("grape_log_freq_scale", config.grape_log_freq_scale)


class GrapeContextual(GrapeM):
    """Contextual GRAPE-M (the authors' Type-I): a running phase from per-token increments."""

    display_name = "GRAPE-M"
    family = "accumulating"
    step_cost = estimated(
        1.35,
        FROM_CPU
        + (
            "grape-m-fixed's rotation plus its increments, so no less than grape-m-fixed's 1.35 (its CPU mean, 0.916,"
            " is below RoPE's: noise)"
        ),
    )

    causal_only = True
    layer_class = GrapeContextualLayer

    @classmethod
    def validate_fields(cls, config) -> None:
        super().validate_fields(config)
        check_bool("grape_ctx_per_head", config.grape_ctx_per_head)
        check_positive_number("grape_ctx_init_omega", config.grape_ctx_init_omega)
        check_positive_number("grape_ctx_omega_scale", config.grape_ctx_omega_scale)


__all__ = ["GrapeContextual", "GrapeContextualLayer", "GrapeFixed", "GrapeFixedLayer", "GrapeM", "Spectrum"]
