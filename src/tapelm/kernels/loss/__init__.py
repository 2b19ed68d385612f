"""The causal-LM loss of hidden states under an output projection: the reference (`naive`: the logits made, then
transformers' loss) and fla's fused linear cross-entropy ("loss-fla", which makes no logits). The model asks for the
loss without logits only while training with labels, and computes its logits and `loss_function` itself where no
candidate takes the call."""

from __future__ import annotations

import torch

from ...fast_paths import FastPaths
from .. import candidates, first
from .naive import IGNORE_INDEX, causal_lm_loss


def _fla(hidden, weight, labels, kwargs):
    from .fla import causal_lm_loss_fla

    return causal_lm_loss_fla(hidden, weight, labels, **kwargs)


CANDIDATES = candidates("loss", ("fla", _fla))


def loss_without_logits(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, paths: FastPaths, **kwargs
) -> torch.Tensor | None:
    """`naive.causal_lm_loss(hidden, weight, labels, **kwargs)` by the first candidate that is on in `paths` and
    takes the call, without making the logits; None where none does."""
    return first(CANDIDATES, paths, hidden, weight, labels, kwargs)


__all__ = ["CANDIDATES", "IGNORE_INDEX", "causal_lm_loss", "loss_without_logits"]
