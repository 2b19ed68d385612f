"""TAPE: contextualised equivariant positional features (shared/TAPE.md §1-§5).

The positional state E travels beside the token features. It lives per key/value head (with GQA a query head reads
the state of its KV group), so the cache holds one [V | E] stream per KV head; where E is still E0, the same for every
head (the first layer), the cache holds E once per token beside V. Two exact representations:

- general: E has shape (B, Hkv, N, M*L*R), one L x R matrix per block of size L of the head dimension
  (M = head_dim / L blocks; block b holds dimensions b, b + M, ..., b + (L-1)M, which for L = 2 is transformers'
  rotate-half pairing).
- compact (L = R = 2, equivariant): starting from RoPE every block stays a scaled rotation [[a, b], [-b, a]], because
  all updates are linear combinations with coefficients shared by the four entries. Such a block is one complex
  number, so E is stored as (B, Hkv, N, head_dim) = [a_0..a_{M-1} | b_0..b_{M-1}], exactly RoPE's cos/sin layout.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.rotation import rotate_queries_and_keys
from ..kernels.state_mixing import fused_when_compiled, mix_state, state_delta
from ..kernels.state_update import in_dtype, update_state
from .base import LayerPositional, PositionalEncoding, PositionContext, check_choice, check_positive
from .costs import measured
from .rotary import TapeRotaryEmbedding, check_even_head_dim, group_queries

TAPE_ATTN_MIXING = ("heads", "per_head")
TAPE_UPDATES = ("both", "attention", "mlp", "none")
TAPE_LAYER_CHOICES = ("all", "none", "first_half", "second_half")


def uses_compact_state(config) -> bool:
    """Whether the d-number scaled-rotation state is exact for this configuration."""
    return tuple(config.tape_block) == (2, 2) and config.tape_equivariant


def state_width(config) -> int:
    """Features per head and token of the positional state."""
    if uses_compact_state(config):
        return config.head_dim
    block_l, block_r = config.tape_block
    return config.head_dim // block_l * block_l * block_r


def initial_blocks(angles: torch.Tensor, block_l: int, block_r: int, scale: float) -> torch.Tensor:
    """RoPE as L x R blocks. angles (..., groups, head_dim/2) float32 -> E0 (..., M, L, R).

    Group g fills columns [gL, (g+1)L) with the rotation at its own frequencies; with one group (R = L),
    q_b -> E_b^T q_b is exactly RoPE on that block."""
    *lead, groups, half = angles.shape
    blocks = half * 2 // block_l
    pairs = block_l // 2
    angles = angles.reshape(*lead, groups, pairs, blocks).transpose(-1, -2)  # (..., G, M, L/2): index j*M + b
    cos, sin = angles.cos() * scale, angles.sin() * scale
    e = angles.new_zeros(*lead, groups, blocks, block_l, block_l)
    j = torch.arange(pairs, device=angles.device)
    e[..., j, j] = cos
    e[..., j, j + pairs] = sin
    e[..., j + pairs, j] = -sin
    e[..., j + pairs, j + pairs] = cos
    return torch.cat(e.unbind(-4), dim=-1)  # (..., M, L, G*L) with R = G*L


class TapeEncoding(PositionalEncoding):
    """Model-level TAPE: the initial state E0 from RoPE (angles in float32, transformers' scalings applied)."""

    reads_position_limit = False
    display_name = "TAPE"
    rope_scaling = True  # E0 is RoPE's rotation under the scaling (tape_block (2, 2), or linear)
    family = "accumulating"
    step_cost = measured(1.36)

    def __init__(self, config):
        super().__init__()
        self.rotary = TapeRotaryEmbedding(config)
        self.compact = uses_compact_state(config)
        self.block_l, self.block_r = config.tape_block
        self.kv_heads = config.num_key_value_heads
        self.config = config

    @classmethod
    def validate_fields(cls, config) -> None:
        """TAPE's options; `tape_layers` as a list becomes its sorted distinct indices."""
        check_choice("tape_attn_mixing", config.tape_attn_mixing, TAPE_ATTN_MIXING)
        check_choice("tape_update", config.tape_update, TAPE_UPDATES)
        check_positive("tape_position_size", config.tape_position_size)
        if len(config.tape_block) != 2:
            raise ValueError(f"tape_block={config.tape_block!r} must be a pair (L, R)")
        for name, value in zip(("tape_block L", "tape_block R"), config.tape_block):
            check_positive(name, value)
        if isinstance(config.tape_layers, str):
            if config.tape_layers not in TAPE_LAYER_CHOICES:
                raise ValueError(
                    f"tape_layers={config.tape_layers!r} is not allowed; choose one of: "
                    f"{', '.join(TAPE_LAYER_CHOICES)}, or a list of layer indices"
                )
            return
        layers = list(config.tape_layers)
        if not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < config.num_hidden_layers for i in layers
        ):
            raise ValueError(
                f"tape_layers={config.tape_layers!r} is not allowed; list layer indices in "
                f"[0, {config.num_hidden_layers}) or use one of: {', '.join(TAPE_LAYER_CHOICES)}"
            )
        config.tape_layers = sorted(set(layers))

    @classmethod
    def validate_config(cls, config) -> None:
        check_even_head_dim(config)
        block_l, block_r = config.tape_block
        if block_l % 2:
            raise ValueError(f"tape_block L={block_l} must be even (the RoPE initialisation pairs dimensions)")
        if config.head_dim % block_l:
            raise ValueError(f"tape_block L={block_l} must divide head_dim={config.head_dim}")
        if block_r % block_l:
            raise ValueError(f"tape_block R={block_r} must be a multiple of L={block_l}")
        rope_type = (config.rope_parameters or {}).get("rope_type", "default")
        if rope_type not in ("default", "linear") and config.tape_block != (2, 2):
            raise ValueError(
                f"rope_parameters rope_type={rope_type!r} needs tape_block=(2, 2); "
                "with other blocks use rope_type 'default' or 'linear'"
            )

    def prepare(self, ctx: PositionContext, dtype: torch.dtype) -> None:
        if self.compact:
            ctx.tables["e0"] = torch.cat(self.rotary.tables(ctx.query_positions, dtype), dim=-1)
            return
        groups = self.block_r // self.block_l
        wide = torch.promote_types(dtype, torch.float32)
        freqs = self.rotary.grouped_frequencies(groups, ctx.query_positions.device, wide)  # (G, d/2)
        angles = ctx.query_positions.to(wide)[..., None, None] * freqs  # (B, N, G, d/2)
        scale = self.rotary.attention_scaling / groups**0.5
        ctx.tables["e0"] = initial_blocks(angles, self.block_l, self.block_r, scale).flatten(-3)

    def initial_state(self, ctx: PositionContext, dtype: torch.dtype) -> torch.Tensor:
        e0 = ctx.tables["e0"].to(dtype)[:, None]
        return e0.expand(-1, self.kv_heads, -1, -1)

    def make_layer(self, layer_idx: int) -> LayerPositional:
        return TapeLayer(self.config, updates=self.config.tape_updates_layer(layer_idx))


class PendingUpdate(NamedTuple):
    """A state whose attention-branch update is still to be added: the state and the attention output of E."""

    state: torch.Tensor
    attended: torch.Tensor


class TapeLayer(LayerPositional):
    """Per-layer TAPE: q/k transformed by E, then E updated through the attention probabilities and a content gate.

    A layer that does not update E (`tape_layers`; always the last, whose E would be discarded) gets no update
    parameters and no [V | E] stream."""

    def __init__(self, config, updates: bool = True):
        super().__init__()
        self.compact = uses_compact_state(config)
        self.head_dim = config.head_dim
        self.block_l, self.block_r = config.tape_block
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        mode = config.tape_update if updates else "none"
        self.attention_update = mode in ("both", "attention")
        self.mlp_update = mode in ("both", "mlp")
        self.per_head = config.tape_attn_mixing == "per_head"
        width = state_width(config)
        if self.attention_update:
            if self.per_head:
                self.attn_gain = nn.Parameter(torch.zeros(self.heads))
            else:
                self.attn_mix = nn.Parameter(torch.zeros(self.kv_heads, self.heads))
        if self.mlp_update:
            self.gate = nn.Linear(config.hidden_size, config.tape_position_size, bias=False)
            self.mix_up = nn.Parameter(torch.zeros(config.tape_position_size, self.kv_heads))
            self.mix_down = nn.Parameter(torch.empty(self.kv_heads, config.tape_position_size))
        self.dense = not config.tape_equivariant and (self.attention_update or self.mlp_update)
        if self.dense:
            self.attn_dense = nn.Parameter(torch.eye(width)) if self.attention_update else None
            self.mlp_dense = nn.Parameter(torch.eye(width)) if self.mlp_update else None

    def init_weights(self, init, std: float) -> None:
        """Zero W_att and W_up (a fresh model computes RoPE's function); small random W_x and W_down."""
        if self.attention_update:
            init.zeros_(self.attn_gain if self.per_head else self.attn_mix)
        if self.mlp_update:
            init.normal_(self.gate.weight, mean=0.0, std=std)
            init.zeros_(self.mix_up)
            init.normal_(self.mix_down, mean=0.0, std=std)
        if self.dense:
            for weight in (self.attn_dense, self.mlp_dense):
                if weight is not None:
                    init.eye_(weight)

    def logit_scale(self, head_dim: int) -> float:
        return self.head_dim**-0.5

    def transform_qk(self, q, k, state, ctx: PositionContext):
        if self.compact:  # each pair rotated by the complex number (a_i, b_i) of the state [a | b]
            return rotate_queries_and_keys(q, k, state, ctx.paths)
        return self._transform_blocks(q, state, grouped=True), self._transform_blocks(k, state, grouped=False)

    def _transform_blocks(self, x: torch.Tensor, state: torch.Tensor, grouped: bool) -> torch.Tensor:
        """x_b -> E_b^T x_b for every block; x (B, heads, N, d) -> (B, heads, N, M*R)."""
        blocks = self.head_dim // self.block_l
        e = state.unflatten(-1, (blocks, self.block_l, self.block_r))
        if grouped:
            x, e = group_queries(x, self.kv_heads), e[:, :, None]
        x = x.unflatten(-1, (self.block_l, blocks)).transpose(-1, -2)
        out = torch.einsum("...ml,...mlr->...mr", x, e)
        return out.flatten(-2).flatten(1, 2) if grouped else out.flatten(-2)

    def value_extra(self, state):
        return state if self.attention_update else None

    def after_attention(self, state, attended, ctx: PositionContext):
        """The equivariant state's head-mixing update waits for the MLP's (`PendingUpdate`): neither feeds the hidden
        states, so `after_mlp` runs both at once (`tapelm.kernels.state_update`)."""
        if not self.attention_update:
            return state
        if not (self.per_head or self.dense):
            return PendingUpdate(state, attended)
        if self.per_head:
            weighted = attended * self.attn_gain.to(attended.dtype)[:, None, None]
            delta = group_queries(weighted, self.kv_heads).sum(2)
        elif fused_when_compiled(attended.shape[-2]):
            delta = (in_dtype(self.attn_mix, attended.dtype)[None, :, :, None, None] * attended[:, None]).sum(2)
        else:  # one (Hkv x H) @ (H x N * F) product per sequence
            batch, heads, length, width = attended.shape
            weight = in_dtype(self.attn_mix, attended.dtype).expand(batch, -1, -1)
            delta = torch.bmm(weight, attended.reshape(batch, heads, -1)).view(batch, self.kv_heads, length, width)
        return state + (delta @ self.attn_dense if self.dense else delta)

    def after_mlp(self, state, mlp_out, ctx: PositionContext):
        pending = state if isinstance(state, PendingUpdate) else None
        if pending is not None:
            state = pending.state
        if not self.mlp_update:
            return state if pending is None else update_state(state, pending.attended, self.attn_mix, None, ctx.paths)
        mix = self._token_maps(F.silu(self.gate(mlp_out)))
        if self.dense:
            return state + state_delta(state, mix) @ self.mlp_dense
        if pending is None:
            return mix_state(state, mix, ctx.paths)
        return update_state(state, pending.attended, self.attn_mix, mix, ctx.paths)

    def _token_maps(self, z: torch.Tensor) -> torch.Tensor:
        """The MLP update's map W_down diag(z) W_up of each token (cheaper than materialising W_up E): z (B, N, I) ->
        (B, N, Hkv, Hkv). A sequence's as z @ K with K[i, (g, h)] = W_down[g, i] W_up[i, h] (autograd keeps only z);
        one token's, in an eager decoding step, as (W_down diag(z)) W_up: two operations where building K takes more
        (a decoding step runs this in every layer, so it avoids even the calls that change nothing)."""
        tokens = z.shape[-2]
        if tokens == 1 and not fused_when_compiled(tokens):  # (Hkv, I) * (B, 1, I): the token axis takes Hkv's place
            maps = in_dtype(self.mix_down * z, z.dtype) @ in_dtype(self.mix_up, z.dtype)
            return maps.unsqueeze(-3)
        pairs = (self.mix_down.t()[:, :, None] * self.mix_up[:, None, :]).flatten(1).to(z.dtype)
        mix = (z[..., None] * pairs).sum(-2) if fused_when_compiled(tokens) else z @ pairs
        return mix.unflatten(-1, (self.kv_heads, self.kv_heads))
