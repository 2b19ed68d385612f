"""GRAPE-AP, GRAPE's path-integral additive encoding (Zhang et al. 2025, arXiv 2512.07805; conventions read from the
authors' model-architectures/GRAPE, model/llama-mha-grape-ap-v1.py, not copied): no rotation of q and k; query i
sees key j with the additive logit bias

    b_h(i, j) = m_h * sum_{l = j+1..i} log sigmoid(p_i . R(l) n_l / d_p)        (b(i, i) = 0)

where p_t is the token's positional vector per head (the layer's attention input after the norm through a projection
of width d_p = `grape_ap_head_dim`, 8 in the authors' runs; or, with `grape_ap_tie` "q", "k" or "v", that
projection's output, d_p = head_dim), n_t = p_t / rms(p_t), R(l) RoPE's rotation of position l at base
`grape_ap_base` (1: every plane turns one radian per position), and m_h ALiBi's slope of query head h. A term that
depends on key l alone is FoX's bias; a constant one ALiBi's (docs/ENCODINGS.md).

Rotation direction as RoPE's (see `tapelm.positional.grape_m`; the authors' code turns the other way, the same
function after negating the second half of every p). Positions are the tokens' own (restarted in every packed
document). Query i sums the terms of the keys after j up to the last key it sees (itself, under tapelm's masks: a
padding token or another packed document never lies between a query and a key it sees). The cache keeps R(l) n_l per
token beside the layer's keys; the bias is built a block of queries at a time (`RowBias`), so attention over blocks
of queries keeps no N x T tensor per head for the backward pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import store_keys_values, store_state
from ..kernels.attention import RowBias
from ..kernels.rotation import rotate_halves
from .base import LayerPositional, PerLayerEncoding, check_choice, check_positive, check_positive_number
from .bias import alibi_slopes
from .costs import FROM_CPU, estimated

GRAPE_AP_TIES = ("none", "q", "k", "v")


def last_seen(valid: torch.Tensor) -> torch.Tensor:
    """The index of the last key each query sees (its own, under a causal mask), (B or 1, 1, N, 1), from the boolean
    mask (B or 1, 1, N, T)."""
    return valid.shape[-1] - 1 - valid.flip(-1).to(torch.uint8).argmax(-1, keepdim=True)


def path_integral_bias(
    p: torch.Tensor, rotated: torch.Tensor, slopes: torch.Tensor, last: torch.Tensor, dtype: torch.dtype
) -> RowBias:
    """The bias m_h sum_{j < l <= last_i} log sigmoid(p_i . rotated_l / d_p) of the new queries' p (B, P, N, d_p) over
    every key's rotated, normalised vector (B, P, T, d_p), P dividing the query heads (slopes (H,)), `last`
    (B or 1, 1, N, 1) the last key each query sees (`last_seen`). As the authors compute it, the difference of two
    running sums of the terms (C_i,last - C_i,j): over long contexts float32 keeps about 1e-7 of the sum as absolute
    error. Built for any block of queries (whose keys reach its last query's), in float32 or wider."""
    wide = torch.promote_types(p.dtype, torch.float32)
    p, rotated, slopes = p.to(wide) / p.shape[-1], rotated.to(wide), slopes.to(wide)[:, None, None]
    groups = slopes.shape[0] // p.shape[1]

    def rows(start: int, end: int, keys: int | None) -> torch.Tensor:
        running = F.logsigmoid(p[..., start:end, :] @ rotated[..., :keys, :].transpose(-1, -2)).cumsum(-1)
        after = running.gather(-1, last[..., start:end, :].expand(*running.shape[:-1], 1)) - running
        if groups > 1:
            after = after.repeat_interleave(groups, dim=1)
        return (after * slopes).to(dtype)

    return RowBias(rows, p.shape[-2])


class GrapeAPLayer(LayerPositional):
    """One layer's positional projection (none when tied to q, k or v); its cache keeps R(l) n_l per token."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.tie = config.grape_ap_tie
        self.heads = config.num_attention_heads
        self.width = config.head_dim if self.tie != "none" else config.grape_ap_head_dim
        self.base = float(config.grape_ap_base)
        if self.tie == "none":
            self.projection = nn.Linear(config.hidden_size, self.heads * self.width, bias=False)

    def positional_vectors(self, x, q, k, stream, value_width) -> torch.Tensor:
        """p (B, P, N, d_p): P = heads untied or tied to q, KV heads tied to k or v."""
        if self.tie == "none":
            batch, length, _ = x.shape
            return self.projection(x).view(batch, length, self.heads, self.width).transpose(1, 2)
        return {"q": q, "k": k, "v": stream[..., :value_width]}[self.tie]

    def rotated(self, p: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """R(l) n_l (B, P, N, d_p) in float32 or wider, for positions (B, N)."""
        wide = torch.promote_types(p.dtype, torch.float32)
        normed = F.rms_norm(p.to(wide), (self.width,))
        exponents = torch.arange(0, self.width, 2, device=p.device, dtype=wide) / self.width
        angles = positions.to(wide)[:, None, :, None] / self.base**exponents
        return rotate_halves(normed, angles.cos(), angles.sin())

    def attention_inputs(self, x, q, k, stream, value_width, cache, layer_idx, valid, ctx):
        p = self.positional_vectors(x, q, k, stream, value_width)
        every = store_state(cache, layer_idx, "grape-ap", self.rotated(p, ctx.query_positions))
        k, stream = store_keys_values(cache, layer_idx, k, stream, value_width)
        slopes = alibi_slopes(self.heads, p.device, torch.promote_types(p.dtype, torch.float32))
        return q, k, stream, path_integral_bias(p, every, slopes, last_seen(valid), q.dtype)


class GrapeAP(PerLayerEncoding):
    """Model level: nothing but the per-layer projections; the bias needs an explicit float mask."""

    reads_position_limit = False
    display_name = "GRAPE-AP"
    relative = False
    family = "decaying"
    step_cost = estimated(
        3.50,
        FROM_CPU
        + (
            "1.712 x CoPE's 5.81 / 2.840 (an N x T sigmoid per head and layer in the bias, as CoPE's gates); "
            "docs/speed/grape-cpu-small/speed-cpu-small.json, commit 84fe1cb"
        ),
    )

    adds_logit_bias = True
    causal_only = True
    layer_class = GrapeAPLayer

    @classmethod
    def validate_fields(cls, config) -> None:
        check_positive_number("grape_ap_base", config.grape_ap_base)
        check_choice("grape_ap_tie", config.grape_ap_tie, GRAPE_AP_TIES)
        check_positive("grape_ap_head_dim", config.grape_ap_head_dim)

    @classmethod
    def validate_config(cls, config) -> None:
        if config.grape_ap_tie == "none" and config.grape_ap_head_dim % 2:
            raise ValueError(
                f"grape_ap_head_dim={config.grape_ap_head_dim} must be even (its vectors are rotated pairwise)"
            )
        if config.grape_ap_tie != "none" and config.head_dim % 2:
            raise ValueError(
                f"head_dim={config.head_dim} must be even with grape_ap_tie={config.grape_ap_tie!r} (the "
                "tied vectors are rotated pairwise)"
            )


__all__ = ["GrapeAP", "GrapeAPLayer", "last_seen", "path_integral_bias"]
