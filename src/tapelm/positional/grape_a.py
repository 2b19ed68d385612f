"""GRAPE-A, GRAPE's gated additive encodings (Zhang et al. 2025, arXiv 2512.07805; conventions read from the authors'
model-architectures/GRAPE, model/llama-mha-grape-a-querygated.py, -keygated.py and -querykeygated.py, not copied):
no rotation of q and k; query i of head h sees key j with the additive logit bias

    b_h(i, j) = -(i - j) * omega_h * g_h(i, j),        omega_h = m_h * softplus(w_h)

with m_h ALiBi's slope of head h, w_h a learned scalar starting at softplus^-1(`grape_a_omega_init`) (1: omega_h = m_h)
and the gate, per token and head, from the layer's own q and k:

    "grape-a-q":  g = softplus(v_h . q_i / sqrt(d))
    "grape-a-k":  g = softplus(u_h . k_j / sqrt(d))
    "grape-a-qk": g = softplus(v_h . q_i / sqrt(d)) + softplus(u_h . k_j / sqrt(d))

where v_h, u_h are learned (head_dim,) directions, L2-normalised (F.normalize, eps 1e-6) unless
`grape_a_gate_l2_norm=False`, starting normal with std 1/sqrt(d). A constant gate c makes the bias ALiBi's with the
slopes m_h softplus(w_h) c. i - j is the difference of the tokens' positions (restarted in every packed document), so
the bias depends on positions only through it. With grouped KV heads query head h gates KV group g(h)'s key with its own
u_h. The gates of cached keys are recomputed from the cached keys: the cache holds nothing beyond keys and positions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.attention import RowBias
from .base import LayerPositional, PerLayerEncoding, check_bool, check_positive_number
from .bias import alibi_slopes, relative_distance
from .costs import estimated

GATE_NORM_EPS = 1e-6


class GrapeALayer(LayerPositional):
    """One layer's per-head rate omega (through softplus) and its gate directions: `query_gate` (v) and/or `key_gate`
    (u), (heads, head_dim) each."""

    def __init__(self, config, gates: tuple[str, ...]):
        super().__init__()
        heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.omega_init = float(config.grape_a_omega_init)
        self.normalize = config.grape_a_gate_l2_norm
        self.omega = nn.Parameter(torch.empty(heads))
        self.query_gate = nn.Parameter(torch.empty(heads, self.head_dim)) if "query" in gates else None
        self.key_gate = nn.Parameter(torch.empty(heads, self.head_dim)) if "key" in gates else None

    def init_weights(self, init, std: float) -> None:
        init.constant_(self.omega, math.log(math.expm1(self.omega_init)))
        for direction in (self.query_gate, self.key_gate):
            if direction is not None:
                init.normal_(direction, std=self.head_dim**-0.5)

    def gate(self, x: torch.Tensor, direction: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
        """softplus(direction_h . x / sqrt(d)) (B, H, L) for x (B, P, L, d), P dividing the heads (a query head reads
        its KV group's keys)."""
        direction = direction.to(wide)
        if self.normalize:
            direction = F.normalize(direction, dim=-1, eps=GATE_NORM_EPS)
        groups, width = x.shape[1], x.shape[-1]
        logits = torch.einsum("bgld,ghd->bghl", x.to(wide), direction.view(groups, -1, width))
        return F.softplus(logits.flatten(1, 2) / math.sqrt(width))

    def logit_bias(self, q, k, valid, ctx):
        wide = torch.promote_types(q.dtype, torch.float32)
        rates = alibi_slopes(self.omega.shape[0], q.device, wide) * F.softplus(self.omega.to(wide))
        distance = relative_distance(ctx).to(wide).clamp_min(0)  # (B or 1, 1, N, T)
        query = self.gate(q, self.query_gate, wide)[..., None] if self.query_gate is not None else None
        key = self.gate(k, self.key_gate, wide)[..., None, :] if self.key_gate is not None else None

        def rows(start: int, end: int, keys: int | None) -> torch.Tensor:
            gate = 0
            if query is not None:
                gate = gate + query[..., start:end, :]
            if key is not None:
                gate = gate + key[..., :keys]
            return (-distance[..., start:end, :keys] * rates[:, None, None] * gate).to(q.dtype)

        return RowBias(rows, q.shape[-2])


class GrapeA(PerLayerEncoding):
    """Model level: nothing but the per-layer gates; the bias reads every key's position and needs an explicit float
    mask. A subclass names its gates ("query", "key")."""

    reads_position_limit = False
    family = "decaying"
    step_cost = estimated(
        2.36,
        (
            "GRAPE-A-Q/K/QK: not measured on any device, nor from CPU ratios; assumed equal to FIRE's measured 2.36 "
            "(each layer's own learned N x T bias with a gradient, through the same attention call as FIRE's, whose "
            "bias is more work: an MLP per query-key pair against GRAPE-A's per-token gates times the distance), so "
            "an upper bound by that argument (tapelm bench speed --device cuda --pe grape-a-q grape-a-k grape-a-qk)"
        ),
    )

    adds_logit_bias = True
    needs_key_positions = True
    causal_only = True
    gates: tuple[str, ...]

    @classmethod
    def validate_fields(cls, config) -> None:
        check_positive_number("grape_a_omega_init", config.grape_a_omega_init)
        check_bool("grape_a_gate_l2_norm", config.grape_a_gate_l2_norm)

    def make_layer(self, layer_idx: int) -> LayerPositional:
        return GrapeALayer(self.config, self.gates)


class GrapeAQuery(GrapeA):
    """GRAPE-A-Q: the gate of the query."""

    display_name = "GRAPE-A-Q"

    gates = ("query",)


class GrapeAKey(GrapeA):
    """GRAPE-A-K: the gate of the key."""

    display_name = "GRAPE-A-K"

    gates = ("key",)


class GrapeAQueryKey(GrapeA):
    """GRAPE-A-QK: the sum of the query's and the key's gates."""

    display_name = "GRAPE-A-QK"

    gates = ("query", "key")


__all__ = ["GrapeA", "GrapeALayer", "GrapeAKey", "GrapeAQuery", "GrapeAQueryKey"]
