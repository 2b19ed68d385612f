"""KERPLE's logarithmic kernel as a tapelm encoding (Chi, Fan, Ramadge, Rudnicky: "KERPLE: Kernelized Relative
Positional Embedding for Length Extrapolation", NeurIPS 2022, arXiv 2205.09921; code: chijames/KERPLE,
`ParallelKerpleLog`).

Every layer adds to its attention logits, per head h, the conditionally positive definite kernel

    bias_h(i, j) = -p_h * log(1 + a_h * (i - j))     for a query at position i and a key at j <= i,

with p_h and a_h learned, drawn at initialisation from U(0, 2) and U(0, 1) and kept at or above `kerple_eps` (0.01),
as the authors' code does. One difference: the authors clamp the parameters in place before every forward pass; here
the clamp is part of the computation (the same logits; below eps a parameter gets no gradient), so that a forward pass
changes no state and compiles.

This package is the worked example of docs/ENCODINGS.md "Add your own encoding": one module, the facts tapelm reads
declared on the class, registered through the entry point in pyproject.toml.
"""

from __future__ import annotations

import torch
from torch import nn

from tapelm.positional import LayerPositional, PerLayerEncoding
from tapelm.positional.base import check_positive_number


class KerpleLogLayer(LayerPositional):
    """One layer's kernel parameters, and the bias they give."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.p = nn.Parameter(torch.empty(config.num_attention_heads))
        self.a = nn.Parameter(torch.empty(config.num_attention_heads))
        self.eps = config.kerple_eps

    def init_weights(self, init, std: float) -> None:
        init.uniform_(self.p, 0.0, 2.0)
        init.uniform_(self.a, 0.0, 1.0)

    def logit_bias(self, q, k, valid, ctx):
        wide = torch.promote_types(q.dtype, torch.float32)
        distance = ctx.query_positions[:, None, :, None] - ctx.key_positions[:, None, None, :]
        distance = distance.clamp(min=0).to(wide)  # a key after its query is masked: 0 keeps the log finite
        p = self.p.to(wide).clamp(min=self.eps)[:, None, None]
        a = self.a.to(wide).clamp(min=self.eps)[:, None, None]
        return (-p * torch.log1p(a * distance)).to(q.dtype)


class KerpleLog(PerLayerEncoding):
    """KERPLE (log): each layer its own kernel, a logit bias of the query's and every key's positions."""

    layer_class = KerpleLogLayer
    needs_key_positions = True  # the decoder hands the layers every key's position, cached ones included
    adds_logit_bias = True  # attention takes an explicit float mask

    display_name = "KERPLE (log)"
    relative = True  # the bias depends on i - j alone
    family = "decaying"  # the bias falls with the distance
    config_fields = {"kerple_eps": 0.01}  # saved in config.json with every model

    @classmethod
    def validate_fields(cls, config) -> None:
        check_positive_number("kerple_eps", config.kerple_eps)


__all__ = ["KerpleLog", "KerpleLogLayer"]
