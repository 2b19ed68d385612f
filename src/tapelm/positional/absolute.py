"""Absolute encodings added to the input embeddings: learned and sinusoidal. NoPE adds nothing at all."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..masks import tracing
from .base import (
    LayerPositional,
    PositionalEncoding,
    PositionContext,
    check_bool,
    check_positive_number,
)
from .costs import measured
from .schedule import encodings_in


class Llama4Temperature(nn.Module):
    """Llama 4's temperature tuning of its NoPE layers: each query's logits times
    1 + attn_scale log1p(floor(n / floor_scale)), n the keys it sees (transformers' Llama4 attention computes it from
    position + 1, which is n in an unpadded causal row; counting the keys keeps a padded or packed row's factors
    those of the row alone)."""

    def __init__(self, config):
        super().__init__()
        self.floor_scale, self.attn_scale = config.nope_floor_scale, config.nope_attn_scale

    def forward(self, keys_seen: torch.Tensor) -> torch.Tensor:
        return 1 + self.attn_scale * torch.log1p(torch.floor(keys_seen / self.floor_scale))


class NoPELayer(LayerPositional):
    """A NoPE layer: q and k as they are, and with `nope_temperature_tuning` Llama 4's factor on the logits."""

    def __init__(self, config):
        super().__init__()
        self.logit_length = Llama4Temperature(config) if config.nope_temperature_tuning else None


class NoPE(PositionalEncoding):
    """No positional encoding: the causal mask is the only source of order (Kazemnejad et al. 2023). With
    `nope_temperature_tuning` its layers scale the logits as Llama 4's NoPE layers do (`Llama4Temperature`)."""

    reads_position_limit = False
    display_name = "NoPE"
    step_cost = measured(0.77)

    def __init__(self, config):
        super().__init__()
        self.config = config

    @classmethod
    def validate_fields(cls, config) -> None:
        check_bool("nope_temperature_tuning", config.nope_temperature_tuning)
        check_positive_number("nope_floor_scale", config.nope_floor_scale)
        check_positive_number("nope_attn_scale", config.nope_attn_scale)
        if config.nope_temperature_tuning and "nope" not in encodings_in(config):
            raise ValueError(
                "nope_temperature_tuning=True is an option of NoPE layers (pe_type='nope', or a layer_pe_types "
                f"schedule holding 'nope'), and no layer of pe_type={config.pe_type!r} is one"
            )

    def make_layer(self, layer_idx: int) -> LayerPositional:
        return NoPELayer(self.config)


class LearnedAbsolute(PositionalEncoding):
    """A trained table of max_position_embeddings vectors added to the token embeddings."""

    relative = False

    def __init__(self, config):
        super().__init__()
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)

    def positions(
        self,
        position_ids: torch.Tensor,
        past: int = 0,
        documents: torch.Tensor | None = None,
        extent: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """The given positions, refused (ValueError) beyond the table."""
        limit = self.position_embeddings.num_embeddings
        if tracing(position_ids):
            return position_ids
        largest = int(position_ids.max()) if extent is None else extent[1] - 1
        if largest >= limit:
            raise ValueError(
                f"position {largest} is beyond the learned table; "
                f"pe_type='learned' allows positions < max_position_embeddings={limit}"
            )
        return position_ids

    def embed(self, hidden: torch.Tensor, ctx: PositionContext) -> torch.Tensor:
        return hidden + self.position_embeddings(ctx.query_positions.clamp(min=0))


class SinusoidalAbsolute(PositionalEncoding):
    """The fixed sin/cos embedding of Vaswani et al. (2017), computed in float32 for any position."""

    reads_position_limit = False
    relative = False

    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size

    def embed(self, hidden: torch.Tensor, ctx: PositionContext) -> torch.Tensor:
        pairs = torch.arange(0, self.hidden_size, 2, dtype=torch.float32, device=hidden.device)
        angles = ctx.query_positions.float()[..., None] * torch.exp(-math.log(10000.0) * pairs / self.hidden_size)
        table = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)[..., : hidden.shape[-1]]
        return hidden + table.to(hidden.dtype)
