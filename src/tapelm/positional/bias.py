"""Additive-bias encodings: ALiBi, T5 relative buckets, FIRE (shared by all layers) and CoPE (per layer).

The relative encodings read the positions of the queries and of every key (cached ones included), so they honour
arbitrary `position_ids`. Their bias goes into SDPA as a float mask.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .base import LayerPositional, PositionalEncoding, PositionContext


def relative_distance(ctx: PositionContext) -> torch.Tensor:
    """query position - key position, (B, 1, N, T) in float32."""
    return (ctx.query_positions[:, None, :, None] - ctx.key_positions[:, None, None, :]).float()


def alibi_slopes(heads: int) -> torch.Tensor:
    """The geometric slopes of Press et al. (2022), including their rule for head counts that are not powers of 2."""
    closest = 2 ** math.floor(math.log2(heads))
    slopes = [2 ** (-8 * (i + 1) / closest) for i in range(closest)]
    if closest < heads:
        extra = [2 ** (-4 * (2 * i + 1) / closest) for i in range(heads - closest)]
        slopes += extra
    return torch.tensor(slopes, dtype=torch.float32)


class RelativeBias(PositionalEncoding):
    """Encodings whose shared bias (B, H, N, T) is a function of query and key positions, set in `prepare`."""

    needs_key_positions = True
    adds_logit_bias = True


class ALiBi(RelativeBias):
    """Attention with linear biases: -slope_h * |i - j|."""

    def __init__(self, config):
        super().__init__()
        self.heads = config.num_attention_heads

    def prepare(self, ctx: PositionContext, dtype: torch.dtype) -> None:
        slopes = alibi_slopes(self.heads).to(ctx.query_positions.device)
        ctx.bias = (-slopes[:, None, None] * relative_distance(ctx).abs()).to(dtype)


class T5Bias(RelativeBias):
    """T5's learned bias per head over log-spaced relative-distance buckets (Raffel et al. 2020)."""

    def __init__(self, config):
        super().__init__()
        self.bidirectional = not config.causal
        self.num_buckets = config.t5_num_buckets
        self.max_distance = config.t5_max_distance
        self.relative_attention_bias = nn.Embedding(self.num_buckets, config.num_attention_heads)

    def buckets(self, distance: torch.Tensor) -> torch.Tensor:
        """Bucket index of each query-minus-key distance."""
        buckets = self.num_buckets
        offset = torch.zeros_like(distance, dtype=torch.long)
        if self.bidirectional:
            buckets //= 2
            offset = (distance < 0).long() * buckets
            distance = distance.abs()
        else:
            distance = distance.clamp(min=0)
        exact = buckets // 2
        log_bucket = exact + (
            torch.log(distance.clamp(min=1) / exact) / math.log(self.max_distance / exact) * (buckets - exact)
        ).long()
        log_bucket = log_bucket.clamp(max=buckets - 1)
        return offset + torch.where(distance < exact, distance.long(), log_bucket)

    def prepare(self, ctx: PositionContext, dtype: torch.dtype) -> None:
        buckets = self.buckets(relative_distance(ctx))[:, 0]
        ctx.bias = self.relative_attention_bias(buckets).permute(0, 3, 1, 2).to(dtype)


class FIRE(RelativeBias):
    """Functional interpolation for relative positions (Li et al. 2024): MLP_h(psi(i-j) / psi(max(i, L))) with
    psi(x) = log(c x + 1) and learnable c and L."""

    def __init__(self, config):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(1, config.fire_hidden_size), nn.ReLU(),
                                 nn.Linear(config.fire_hidden_size, config.num_attention_heads))
        self.log_c = nn.Parameter(torch.zeros(()))
        self.threshold = nn.Parameter(torch.tensor(float(config.max_position_embeddings)))

    def prepare(self, ctx: PositionContext, dtype: torch.dtype) -> None:
        distance = relative_distance(ctx).abs()
        c = self.log_c.exp()
        query = ctx.query_positions.float()[:, None, :, None]
        normaliser = torch.log(c * torch.maximum(query, self.threshold.abs()) + 1)
        features = torch.log(c * distance + 1) / normaliser
        ctx.bias = self.mlp(features[..., None].to(self.mlp[0].weight.dtype))[:, 0].permute(0, 3, 1, 2).to(dtype)


class CoPE(PositionalEncoding):
    """Contextual position encoding (Golovneva et al. 2024): positions are counts of gated keys."""

    adds_logit_bias = True

    def __init__(self, config):
        super().__init__()
        self.config = config

    def make_layer(self, layer_idx: int) -> LayerPositional:
        return CoPELayer(self.config)


class CoPELayer(LayerPositional):
    """p_ij = sum_{k=j..i} sigmoid(q_i . k_k); bias = q_i . e[p_ij], interpolating between integer positions."""

    def __init__(self, config):
        super().__init__()
        self.max_positions = config.cope_max_positions
        self.kv_groups = config.num_attention_heads // config.num_key_value_heads
        self.pos_emb = nn.Parameter(torch.zeros(config.head_dim, config.cope_max_positions))

    def init_weights(self, init, std: float) -> None:
        init.zeros_(self.pos_emb)

    def logit_bias(self, q, k, valid, ctx):
        k = k.repeat_interleave(self.kv_groups, dim=1)
        wide = torch.promote_types(q.dtype, torch.float32)
        gates = torch.sigmoid((q @ k.transpose(-1, -2)).to(wide) * q.shape[-1] ** -0.5)
        if valid is not None:
            gates = gates * valid
        positions = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=self.max_positions - 1)
        lower = positions.floor().long()
        upper = (lower + 1).clamp(max=self.max_positions - 1)
        weight = positions - lower
        table = (q @ self.pos_emb.to(q.dtype)).to(wide)  # (B, H, N, P)
        return (table.gather(-1, lower) * (1 - weight) + table.gather(-1, upper) * weight).to(q.dtype)
