"""Selective RoPE (Movahedi, Carstensen et al., ICLR 2026, "Selective Rotary Position Embedding", arXiv 2511.17388):
RoPE whose angles are a running sum of phases the content chooses.

Every token s brings a phase phi_s per KV head and rotate-half pair; q_t and k_t are both rotated by
omega * sum_{s <= t} phi_s, so query i sees key j through the phases of the tokens after j up to i:

    logit(i, j) = q_i^T R(omega * sum_{s=j+1..i} phi_s) k_j / sqrt(d)

Conventions read from the authors' code (timurcarstensen/selective-rope, `selective_rope/modules/rotary.py`
`SelectiveRoPE` and `layers/attn.py`, with its configs' values), not copied:

- phi_s: the layer's attention input x_s (after the norm), L2-normalised in num_attention_heads chunks (fla's
  l2_norm, eps 1e-6 under the root), through a low-rank projection hidden -> `selective_rope_rank` (32) -> one phase
  per pair and head without biases, then a depthwise causal convolution of `selective_rope_conv_size` (4) without
  bias (fla's `ShortConvolution`), `selective_rope_conv_activation` (None, or "silu") after it.
- `selective_rope_bias`: phi + exp(b), b per head and pair starting at 0 (the authors' `use_bias`: at the start
  every token adds 1, which is RoPE's angle, position x omega, plus the content's).
- `selective_rope_gate`: phi times a sigmoid gate of the normalised input, per head ("standard": one linear map with
  bias; "low-rank": through `selective_rope_gate_rank` (16)) or per head and pair ("gla": low-rank), the authors'
  `use_gate` with its `gate_parametrization`.
- omega: `selective_rope_temperature` (1) / theta ** (2i / head_dim) with theta `selective_rope_theta` (500000):
  the authors' temperature of type "rope", not learned (their `temp_grad` False), computed in the sums' precision.
- The rotation pairs dimension i with i + head_dim / 2 in RoPE's direction, as theirs.

Where tapelm's differs (docs/ENCODINGS.md): the phases are per KV head, the query heads of a group sharing their KV
head's angles (the authors' layer needs as many KV heads as query heads: with fewer it fails); padding tokens bring
no phase and the convolution reads no padding nor another packed document (theirs sums and convolves the padding of
a left-padded row); a cache carries the running sum and the convolution's inputs. The sums are computed and cached
in float32 (float64 in a float64 model) whatever the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import last_cached_state, store_keys_values, store_state
from ..kernels.rotation import rotate_queries_and_keys
from .base import (
    CustomInit,
    LayerPositional,
    PerLayerEncoding,
    check_bool,
    check_choice,
    check_positive,
    check_positive_number,
)
from .convolution import short_convolution
from .costs import estimated
from .rotary import check_even_head_dim

GATES = (None, "standard", "low-rank", "gla")
CONV_ACTIVATIONS = (None, "silu")
L2_NORM_EPS = 1e-6


class PhaseBias(CustomInit):
    """b per KV head and pair (Hkv, head_dim / 2), starting at 0: the phases gain exp(b)."""

    def __init__(self, kv_heads: int, pairs: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(kv_heads, pairs))

    def init_weights(self, init, std: float) -> None:
        init.zeros_(self.bias)


class SelectiveRoPELayer(LayerPositional):
    """One layer's phase projection, convolution, optional bias and gate, and its running sums in the cache."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.chunks, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.pairs = config.head_dim, config.head_dim // 2
        width = self.kv_heads * self.pairs
        rank = config.selective_rope_rank
        hidden = config.hidden_size
        self.phase_proj = nn.Sequential(nn.Linear(hidden, rank, bias=False), nn.Linear(rank, width, bias=False))
        self.phase_conv = nn.Conv1d(width, width, config.selective_rope_conv_size, groups=width, bias=False)
        self.conv_activation = config.selective_rope_conv_activation
        self.phase_bias = PhaseBias(self.kv_heads, self.pairs) if config.selective_rope_bias else None
        self.gate = self._gate(config.selective_rope_gate, hidden, config.selective_rope_gate_rank, width)
        self.theta, self.temperature = config.selective_rope_theta, config.selective_rope_temperature
        self.layer_idx = layer_idx

    def _gate(self, kind: str | None, hidden: int, rank: int, width: int) -> nn.Module | None:
        if kind is None:
            return None
        if kind == "standard":
            return nn.Linear(hidden, self.kv_heads, bias=True)
        out = self.kv_heads if kind == "low-rank" else width
        return nn.Sequential(nn.Linear(hidden, rank, bias=False), nn.Linear(rank, out, bias=True))

    def phases(self, x: torch.Tensor, ctx, cache, valid) -> torch.Tensor:
        """phi (B, N, Hkv, head_dim / 2) of the new tokens in float32 or wider; 0 at padding tokens."""
        wide = torch.promote_types(x.dtype, torch.float32)
        batch, length, hidden = x.shape
        chunks = x.view(batch, length, self.chunks, -1)
        normed = (chunks * torch.rsqrt(chunks.pow(2).sum(-1, keepdim=True) + L2_NORM_EPS)).view(batch, length, hidden)
        phi = short_convolution(self.phase_proj(normed), self.phase_conv.weight, cache, self.layer_idx, valid)
        if self.conv_activation == "silu":
            phi = F.silu(phi)
        phi = phi.to(wide).view(batch, length, self.kv_heads, self.pairs)
        if self.phase_bias is not None:
            phi = phi + self.phase_bias.bias.to(wide).exp()
        if self.gate is not None:
            gate = torch.sigmoid(self.gate(normed).to(wide)).view(batch, length, self.kv_heads, -1)
            phi = phi * gate
        if ctx.token_mask is not None:
            phi = phi * ctx.token_mask[..., None, None]
        return phi

    def attention_inputs(self, x, q, k, stream, value_width, cache, layer_idx, valid, ctx):
        phi = self.phases(x, ctx, cache, valid)
        running = phi.cumsum(1).transpose(1, 2)  # (B, Hkv, N, pairs)
        past = last_cached_state(cache, layer_idx, "selective rope")
        if past is not None:
            running = running + past
        store_state(cache, layer_idx, "selective rope", running)
        exponents = torch.arange(0, self.head_dim, 2, dtype=running.dtype, device=running.device) / self.head_dim
        angles = running * (self.temperature / self.theta**exponents)
        table = torch.cat([angles.cos(), angles.sin()], dim=-1).to(q.dtype)
        q, k = rotate_queries_and_keys(q, k, table, ctx.paths)
        k, stream = store_keys_values(cache, layer_idx, k, stream, value_width)
        return q, k, stream, None


class SelectiveRoPE(PerLayerEncoding):
    """Model level: nothing but the per-layer phases. The convolution reads the cached inputs as a sequence (a static
    cache hands over only what is written)."""

    reads_position_limit = False
    display_name = "Selective RoPE"
    family = "accumulating"
    step_cost = estimated(
        1.36,
        (
            "not measured on any device; assumed equal to TAPE's measured 1.36: both rotate q and k by per-token "
            "tables of each KV head through the same rotation kernels, and TAPE's state update does more work per "
            "token than Selective RoPE's low-rank phases, convolution and running sum, so an upper bound"
        ),
    )

    fixed_shape_cache = False
    layer_class = SelectiveRoPELayer
    test_options = {"selective_rope_rank": 8}

    @classmethod
    def validate_fields(cls, config) -> None:
        check_positive("selective_rope_rank", config.selective_rope_rank)
        check_positive("selective_rope_conv_size", config.selective_rope_conv_size)
        check_choice("selective_rope_conv_activation", config.selective_rope_conv_activation, CONV_ACTIVATIONS)
        check_positive_number("selective_rope_theta", config.selective_rope_theta)
        check_positive_number("selective_rope_temperature", config.selective_rope_temperature)
        check_bool("selective_rope_bias", config.selective_rope_bias)
        check_choice("selective_rope_gate", config.selective_rope_gate, GATES)
        check_positive("selective_rope_gate_rank", config.selective_rope_gate_rank)

    @classmethod
    def validate_config(cls, config) -> None:
        check_even_head_dim(config)
