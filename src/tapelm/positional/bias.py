"""Additive-bias encodings: ALiBi, T5 relative buckets, FIRE (both per layer by default, as the paper ran them)
and CoPE (per layer).

The relative encodings read the positions of the queries and of every key (cached ones included), so they honour
arbitrary `position_ids`. Their bias goes into SDPA as a float mask.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..kernels.attention import RowBias
from ..masks import tracing
from .base import (
    CustomInit,
    LayerPositional,
    PerLayerEncoding,
    PositionalEncoding,
    PositionContext,
    check_bool,
    check_positive,
    check_positive_number,
)
from .costs import measured


def shared_positions(ctx: PositionContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The query (B, N) and key (B, T) positions, as one row (batch 1) when every sequence has the same ones (a batch
    without padding: the positions are one row expanded), so that a bias is computed and kept once, not per
    sequence."""
    queries, keys = ctx.query_positions, ctx.key_positions
    if queries.stride(0) == 0 and keys.stride(0) == 0:
        return queries[:1], keys[:1]
    return queries, keys


def relative_distance(ctx: PositionContext) -> torch.Tensor:
    """query position - key position, (B or 1, 1, N, T) in float32 (one row when all sequences share positions)."""
    queries, keys = shared_positions(ctx)
    return (queries[:, None, :, None] - keys[:, None, None, :]).float()


def alibi_slopes(heads: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The geometric slopes of Press et al. (2022), including their rule for head counts that are not powers of 2,
    computed on `device` (no host-to-device copy in a forward pass) in float64 and rounded once to `dtype`: each
    slope is the correctly rounded 2^(exponent) (exp2 in float32 misses it by a step at some head counts)."""
    closest = 2 ** math.floor(math.log2(heads))
    index = torch.arange(heads, dtype=torch.float64, device=device)
    powers = torch.where(index < closest, -8 * (index + 1), -4 * (2 * (index - closest) + 1)) / closest
    return torch.exp2(powers).to(dtype)


class RelativeBias(PositionalEncoding):
    """Encodings whose shared bias (B, H, N, T) is a function of query and key positions, set in `prepare`."""

    reads_position_limit = False
    needs_key_positions = True
    adds_logit_bias = True


class ALiBi(RelativeBias):
    """Attention with linear biases: -slope_h * |i - j|."""

    display_name = "ALiBi"
    family = "decaying"
    step_cost = measured(1.02)

    def __init__(self, config):
        super().__init__()
        self.heads = config.num_attention_heads

    def prepare(self, ctx: PositionContext, dtype: torch.dtype) -> None:
        wide = torch.promote_types(dtype, torch.float32)
        slopes = alibi_slopes(self.heads, ctx.query_positions.device, wide)
        ctx.bias = (-slopes[:, None, None] * relative_distance(ctx).to(wide).abs()).to(dtype)


class T5Bias(RelativeBias):
    """T5's learned bias per head over log-spaced relative-distance buckets (Raffel et al. 2020).

    By default every layer has its own table, as the paper's official code (VITA-Group/TAPE, models/llama/t5rb.py,
    `relative_attention_bias` built inside each attention layer); `t5_shared=True` shares one table across layers, as
    T5 itself does. The bucket of every (query, key) pair is computed once per forward pass."""

    display_name = "T5"
    step_cost = measured(6.86)

    def __init__(self, config):
        super().__init__()
        self.bidirectional = not config.causal
        self.num_buckets = config.t5_num_buckets
        self.max_distance = config.t5_max_distance
        self.shared = config.t5_shared
        self.config = config
        if self.shared:
            self.relative_attention_bias = nn.Embedding(self.num_buckets, config.num_attention_heads)

    @classmethod
    def validate_fields(cls, config) -> None:
        check_positive("t5_num_buckets", config.t5_num_buckets)
        check_positive("t5_max_distance", config.t5_max_distance)
        check_bool("t5_shared", config.t5_shared)

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
        log_bucket = (
            exact
            + (
                torch.log(distance.clamp(min=1) / exact) / math.log(self.max_distance / exact) * (buckets - exact)
            ).long()
        )
        log_bucket = log_bucket.clamp(max=buckets - 1)
        return offset + torch.where(distance < exact, distance.long(), log_bucket)

    def prepare(self, ctx: PositionContext, dtype: torch.dtype) -> None:
        buckets = self.buckets(relative_distance(ctx))[:, 0]
        if self.shared:
            ctx.bias = t5_bias(self.relative_attention_bias, buckets, dtype)
        else:
            ctx.tables["t5_buckets"] = buckets

    def make_layer(self, layer_idx: int) -> LayerPositional:
        return LayerPositional() if self.shared else T5Layer(self.config)


def t5_bias(table: nn.Embedding, buckets: torch.Tensor, dtype: torch.dtype) -> RowBias:
    """Bias (B, H, N, T) from bucket indices (B, N, T), looked up a block of queries at a time."""
    return RowBias(
        lambda start, end, keys: table(buckets[:, start:end, :keys]).permute(0, 3, 1, 2).to(dtype), buckets.shape[1]
    )


class T5Layer(LayerPositional):
    """One layer's own T5 bias table (the default, `t5_shared=False`)."""

    def __init__(self, config):
        super().__init__()
        self.relative_attention_bias = nn.Embedding(config.t5_num_buckets, config.num_attention_heads)

    def logit_bias(self, q, k, valid, ctx):
        return t5_bias(self.relative_attention_bias, ctx.tables["t5_buckets"], q.dtype)


class FireFunction(CustomInit):
    """FIRE's learned function of (query, key) positions (Li et al. 2024):
    MLP_h( psi(i - j) / (psi(max(i, L)) + eps) ), psi(x) = log(|c x| + 1), MLP 1 -> fire_hidden_size -> heads.

    Parametrised as the paper's official code (VITA-Group/TAPE, models/llama/fire.py, `FIRE(init_c=0.1,
    init_L=512.0, eps=1e-6)`): c is learned directly (init `fire_init_c`), the threshold is
    L = |m * fire_init_threshold| with a learned multiplier m (init 1) and a fixed base."""

    eps = 1e-6

    def __init__(self, config):
        super().__init__()
        self.init_c = float(config.fire_init_c)
        self.init_threshold = float(config.fire_init_threshold)
        self.mlp = nn.Sequential(
            nn.Linear(1, config.fire_hidden_size),
            nn.ReLU(),
            nn.Linear(config.fire_hidden_size, config.num_attention_heads),
        )
        # shape (1,), not scalars: FSDP2's fully_shard cannot shard a 0-dimensional parameter
        self.c = nn.Parameter(torch.full((1,), self.init_c))
        self.threshold_multiplier = nn.Parameter(torch.ones(1))

    def init_weights(self, init, std: float) -> None:
        init.constant_(self.c, self.init_c)
        init.constant_(self.threshold_multiplier, 1.0)

    def forward(self, ctx: PositionContext, dtype: torch.dtype) -> RowBias:
        """The bias (B, H, N, T), or (1, H, N, T) when every sequence has the same positions, for the context's query
        and key positions, built a block of queries at a time. The MLP runs once per distinct row of positions (one
        for a batch without padding), not once per sequence: its hidden layer is the largest tensor FIRE makes (not in
        a decoding step, whose one query makes it small: finding the distinct rows reads the device each step).
        While tracing the number of distinct rows is data, so there it runs once per sequence unless the positions
        are one row expanded (no padding)."""
        length = ctx.query_positions.shape[1]
        queries, keys = shared_positions(ctx)
        rows = torch.cat([queries, keys], dim=1)
        index = None
        if len(rows) > 1 and length > 1 and not tracing(rows):  # a decoding step's MLP is a row per key: cheap
            rows, index = distinct_rows(rows, ctx.distinct_rows)
        queries, keys = rows[:, :length], rows[:, length:]

        def block(start: int, end: int, seen: int | None) -> torch.Tensor:
            bias = self._bias(queries[:, start:end], keys[:, :seen], dtype)
            return bias if index is None or len(rows) == 1 else bias[index]

        return RowBias(block, length)

    def _bias(self, queries: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The bias (R, H, n, T) for rows of query positions (R, n) and key positions (R, T)."""
        wide = torch.promote_types(self.mlp[0].weight.dtype, torch.float32)
        distance = (queries[:, None, :, None] - keys[:, None, None, :]).to(wide).abs()
        query = queries.to(wide)[:, None, :, None]
        c = self.c.to(wide)
        threshold = (self.threshold_multiplier.to(wide) * self.init_threshold).abs()
        normaliser = torch.log((c * torch.maximum(query, threshold)).abs() + 1)
        features = torch.log((c * distance).abs() + 1) / (normaliser + self.eps)
        return self.mlp(features[..., None].to(self.mlp[0].weight.dtype))[:, 0].permute(0, 3, 1, 2).to(dtype)


class FIRE(RelativeBias):
    """FIRE (see `FireFunction`). By default every layer has its own module, as the official code builds
    `FIRE(num_heads)` inside each attention layer; `fire_shared=True` shares one module across layers."""

    display_name = "FIRE"
    relative = False  # positions are normalised by the query's (past its threshold)
    step_cost = measured(2.36)
    test_options = {"fire_hidden_size": 8}

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.shared = config.fire_shared
        if self.shared:
            self.fire = FireFunction(config)

    @classmethod
    def validate_fields(cls, config) -> None:
        check_positive("fire_hidden_size", config.fire_hidden_size)
        check_bool("fire_shared", config.fire_shared)
        check_positive_number("fire_init_c", config.fire_init_c)
        check_positive_number("fire_init_threshold", config.fire_init_threshold)

    def prepare(self, ctx: PositionContext, dtype: torch.dtype) -> None:
        if self.shared:
            ctx.bias = self.fire(ctx, dtype)

    def make_layer(self, layer_idx: int) -> LayerPositional:
        return LayerPositional() if self.shared else FIRELayer(self.config)


def distinct_rows(rows: torch.Tensor, known: tuple[torch.Tensor, torch.Tensor] | None):
    """`torch.unique(rows, dim=0, return_inverse=True)`, from the indices the host `known` where it gives them."""
    if known is None:
        return torch.unique(rows, dim=0, return_inverse=True)
    first, index = known
    return rows.index_select(0, first), index


class FIRELayer(LayerPositional):
    """One layer's own FIRE module (the default, `fire_shared=False`)."""

    def __init__(self, config):
        super().__init__()
        self.fire = FireFunction(config)

    def logit_bias(self, q, k, valid, ctx):
        return self.fire(ctx, q.dtype)


class CoPELayer(LayerPositional):
    """p_ij = sum_{k=j..i} sigmoid(q_i . k_k); bias = q_i . e[p_ij], interpolating between integer positions."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.max_positions = config.cope_max_positions
        self.kv_groups = config.num_attention_heads // config.num_key_value_heads
        self.pos_emb = nn.Parameter(torch.zeros(config.head_dim, config.cope_max_positions))

    def init_weights(self, init, std: float) -> None:
        init.zeros_(self.pos_emb)

    def logit_bias(self, q, k, valid, ctx):
        k = k.repeat_interleave(self.kv_groups, dim=1)
        return RowBias(
            lambda start, end, keys: self._bias(
                q[..., start:end, :], k[..., :keys, :], None if valid is None else valid[..., start:end, :keys]
            ),
            q.shape[-2],
        )

    def _bias(self, q, k, valid):
        """The bias (B, H, n, T) of a block of queries q (B, H, n, d) over every key k (B, H, T, d)."""
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


class CoPE(PerLayerEncoding):
    """Contextual position encoding (Golovneva et al. 2024): positions are counts of gated keys."""

    reads_position_limit = False
    display_name = "CoPE"
    step_cost = measured(5.81)
    test_options = {"cope_max_positions": 16}

    adds_logit_bias = True
    layer_class = CoPELayer

    @classmethod
    def validate_fields(cls, config) -> None:
        check_positive("cope_max_positions", config.cope_max_positions)
