"""Stick-breaking attention (Tan, Yang et al., ICLR 2025, "Scaling Stick-Breaking Attention: An Efficient
Implementation and In-depth Study"): attention weights that are no softmax and need no position signal.

Walking back from query i over the keys it sees, each key j takes the share sigmoid(z_ij) of the stick the nearer
keys left, z_ij = q_i . k_j / sqrt(d):

    A_ij = sigmoid(z_ij) prod_{j < l < i} (1 - sigmoid(z_il)),    out_i = sum_j A_ij v_j

(l <= i with `stickbreaking_attend_current`: the query sees its own key). As fla's model (fla.layers
StickBreakingAttention), the stick left over, 1 - sum_j A_ij, is dropped and no bias enters z; the authors' model
also mixes the leftover with a learned per-head vector and normalises the heads' outputs (docs/ENCODINGS.md). The
order from the nearest key is what carries position: the layer computes its attention itself
(`LayerPositional.attend`), through `tapelm.kernels.stickbreaking_attention`.
"""

from __future__ import annotations

from ..kernels.attention import joined_stream
from ..kernels.stickbreaking_attention import stickbreaking_attention
from .base import LayerPositional, PerLayerEncoding, check_bool
from .costs import estimated


class StickBreakingLayer(LayerPositional):
    """One layer's stick-breaking attention over its keys, cached ones included; no parameters."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.attend_current = config.stickbreaking_attend_current

    def attend(self, q, k, stream, shared, mask, scale, ctx, probabilities=False):
        stream = joined_stream(stream, shared)
        return stickbreaking_attention(q, k, stream, mask, scale, self.attend_current, ctx.paths, probabilities)


class StickBreaking(PerLayerEncoding):
    """Model level: nothing but the layers; causal only (the stick breaks from the nearest earlier key)."""

    reads_position_limit = False
    display_name = "Stick-breaking"
    family = "decaying"
    step_cost = estimated(
        5.81,
        (
            "not measured on any device; on CUDA's default paths it runs its plain PyTorch reference, whose work per "
            "query-key pair is CoPE's kind (a transcendental of each logit and a running sum over the keys), so "
            "assumed equal to CoPE's measured 5.81; fla's kernel, once a visit verifies it, should cost far less"
        ),
    )

    causal_only = True
    softmax_of_logits = False
    layer_class = StickBreakingLayer

    @classmethod
    def validate_fields(cls, config) -> None:
        check_bool("stickbreaking_attend_current", config.stickbreaking_attend_current)
