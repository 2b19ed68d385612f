"""The reference causal-LM loss: the logits hidden @ weight^T made, then transformers' `ForCausalLMLoss` (what a
model's `loss_function` computes for causal language modelling)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.loss.loss_utils import ForCausalLMLoss

IGNORE_INDEX = -100


def causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch=None,
    shift_labels: torch.Tensor | None = None,
    **_,
) -> torch.Tensor:
    """Token t predicts label t + 1 (or `shift_labels[t]`), `IGNORE_INDEX` labels count for nothing, the mean over
    the counted tokens or the sum over `num_items_in_batch`."""
    return ForCausalLMLoss(
        F.linear(hidden, weight),
        labels,
        weight.shape[0],
        num_items_in_batch,
        ignore_index=IGNORE_INDEX,
        shift_labels=shift_labels,
    )


__all__ = ["IGNORE_INDEX", "causal_lm_loss"]
