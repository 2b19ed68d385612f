"""PoPE, polar coordinate position embedding (Gopalakrishnan, Csordas, Schmidhuber, Mozer 2025, arXiv 2509.10534;
conventions read from lucidrains/x-transformers' `PolarEmbedding` and `apply_polar_pos_emb`, not copied): each of the
d features of a query or key head becomes one complex number whose magnitude is content only, softplus(x_c), and
whose phase is position only, t theta_c, so that query i of head h sees key j through

    logit = sum_c softplus(q_c) softplus(k_c) cos((i - j) theta_c - delta_h,c) / sqrt(d)

with d frequencies theta_c = rope_theta ** (-c / d), c < d (RoPE's spectrum for a head of width 2d,
`rope_frequencies`), and a learned phase offset delta per query head and frequency, clamped to [-2 pi, 0] and
starting at 0 (`pope_bias_init` "zero") or uniform in [-2 pi, 0] ("uniform"): each layer its own (the default), or
one set shared by every layer (`pope_shared_bias`, as x-transformers builds one `PolarEmbedding` for all layers).

q and k leave the hook as [m cos | m sin], twice head_dim wide: RoPE's rotate-half layout of the complex numbers
m e^{i phase}, whose dot product is the real part above; the softmax scale stays 1/sqrt(head_dim), as x-transformers'.
x-transformers adds delta to the key's phase; tapelm subtracts it from the query's (the same logits), so that cached
keys depend on the key and its position only and a query head of a grouped KV head has its own offsets. Magnitudes,
angles and products are computed in float32 (float64 in a float64 model), q and k returned in their own dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import LayerPositional, PositionalEncoding, PositionContext, check_bool, check_choice
from .costs import FROM_CPU, estimated
from .rotary import rope_frequencies

POPE_BIAS_INITS = ("zero", "uniform")


def polar(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[m cos | m sin] with magnitudes m = softplus(x), computed in cos's dtype and returned in x's; x (..., d), cos and
    sin broadcasting to it."""
    magnitude = F.softplus(x.to(cos.dtype))
    return torch.cat([magnitude * cos, magnitude * sin], dim=-1).to(x.dtype)


def phase_offsets(config) -> nn.Parameter:
    """The offsets delta of one layer, or of every layer when they are shared: (heads, head_dim), set by
    `init_phase_offsets`."""
    return nn.Parameter(torch.empty(config.num_attention_heads, config.head_dim))


def init_phase_offsets(init, offsets: torch.Tensor, config) -> None:
    """0 (`pope_bias_init` "zero"), or uniform on [-2 pi, 0] ("uniform")."""
    if config.pope_bias_init == "uniform":
        init.uniform_(offsets, -2 * math.pi, 0.0)
    else:
        init.zeros_(offsets)


class PoPELayer(LayerPositional):
    """One layer's phase offsets delta (heads, head_dim), applied to the queries' phases; with `pope_shared_bias` the
    offsets every layer shares, which the model level hands over in `ctx.tables["phase_bias"]`."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.phase_bias = None if config.pope_shared_bias else phase_offsets(config)

    def init_weights(self, init, std: float) -> None:
        if self.phase_bias is not None:
            init_phase_offsets(init, self.phase_bias, self.config)

    def transform_qk(self, q, k, state, ctx: PositionContext):
        cos, sin = ctx.tables["polar"].unbind(0)  # (B or 1, 1, N, d)
        offsets = ctx.tables["phase_bias"] if self.phase_bias is None else self.phase_bias
        delta = offsets.to(cos.dtype).clamp(-2 * math.pi, 0.0)[:, None]  # (H, 1, d)
        shift_cos, shift_sin = delta.cos(), delta.sin()  # the query's phase t theta - delta
        return polar(q, cos * shift_cos + sin * shift_sin, sin * shift_cos - cos * shift_sin), polar(k, cos, sin)


class PoPE(PositionalEncoding):
    """Model level: the phases t theta of this pass's positions, shared by every layer."""

    reads_position_limit = False
    display_name = "PoPE"
    step_cost = estimated(
        1.62,
        FROM_CPU
        + (
            "its CPU ratio 1.30 (docs/speed/pope-cpu-small/speed-cpu-small.json, commit 250b432; 95% interval +-1.26)"
            " times TAPE's GPU-over-CPU ratio 1.36 / 1.094 (per-token transforms of q and k and an attention call "
            "over a stream twice head_dim wide, as TAPE's); tapelm bench speed --device cuda --pe pope should measure"
            " it"
        ),
    )

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.theta = float(config.rope_parameters["rope_theta"])
        self.phase_bias = phase_offsets(config) if config.pope_shared_bias else None

    def init_weights(self, init, std: float) -> None:
        if self.phase_bias is not None:
            init_phase_offsets(init, self.phase_bias, self.config)

    @classmethod
    def validate_fields(cls, config) -> None:
        check_choice("pope_bias_init", config.pope_bias_init, POPE_BIAS_INITS)
        check_bool("pope_shared_bias", config.pope_shared_bias)

    @classmethod
    def validate_config(cls, config) -> None:
        rope_type = (config.rope_parameters or {}).get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(
                f"rope_parameters rope_type={rope_type!r} is not allowed with pe_type='pope': its frequencies are "
                "the default spectrum from rope_theta"
            )

    def prepare(self, ctx: PositionContext, dtype: torch.dtype) -> None:
        """`ctx.tables["polar"]`: cos and sin of the phases, stacked (2, B or 1, 1, N, head_dim), in float32 or
        wider."""
        wide = torch.promote_types(dtype, torch.float32)
        positions = ctx.query_positions[:1] if ctx.query_positions.stride(0) == 0 else ctx.query_positions
        frequencies = rope_frequencies(self.theta, 2 * self.config.head_dim, positions.device).to(wide)
        angles = positions[:, None, :, None].to(wide) * frequencies
        ctx.tables["polar"] = torch.stack([angles.cos(), angles.sin()])
        if self.phase_bias is not None:
            ctx.tables["phase_bias"] = self.phase_bias

    def make_layer(self, layer_idx: int) -> LayerPositional:
        return PoPELayer(self.config, layer_idx)


__all__ = ["PoPE", "PoPELayer", "polar"]
