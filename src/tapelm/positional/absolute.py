"""Absolute encodings added to the input embeddings: learned and sinusoidal. NoPE adds nothing at all."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..masks import tracing
from .base import PositionalEncoding, PositionContext
from .costs import measured


class NoPE(PositionalEncoding):
    """No positional encoding: the causal mask is the only source of order (Kazemnejad et al. 2023)."""

    display_name = "NoPE"
    step_cost = measured(0.77)

    def __init__(self, config):
        super().__init__()


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

    relative = False

    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size

    def embed(self, hidden: torch.Tensor, ctx: PositionContext) -> torch.Tensor:
        pairs = torch.arange(0, self.hidden_size, 2, dtype=torch.float32, device=hidden.device)
        angles = ctx.query_positions.float()[..., None] * torch.exp(-math.log(10000.0) * pairs / self.hidden_size)
        table = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)[..., : hidden.shape[-1]]
        return hidden + table.to(hidden.dtype)
