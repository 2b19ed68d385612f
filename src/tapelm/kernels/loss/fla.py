"""The causal-LM loss through fla's fused linear cross-entropy (fast path "loss-fla"): the output projection and
the cross-entropy a chunk of tokens at a time, so no full logits tensor is made or kept."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import fla_function
from .naive import IGNORE_INDEX


def kernel(x: torch.Tensor):
    """fla's `fused_linear_cross_entropy_loss` for tensors like `x`, or None where it does not run."""
    return fla_function(x, "fla.modules.fused_linear_cross_entropy", "fused_linear_cross_entropy_loss")


def causal_lm_loss_fla(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch=None,
    shift_labels: torch.Tensor | None = None,
    **_,
) -> torch.Tensor | None:
    """`naive.causal_lm_loss` with its semantics (the label shift, `IGNORE_INDEX`, the sum divided by
    `num_items_in_batch` under gradient accumulation), in passes with gradients; None where the kernel does not take
    the call."""
    fused_linear_cross_entropy_loss = kernel(hidden) if torch.is_grad_enabled() else None
    if fused_linear_cross_entropy_loss is None:
        return None
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = fused_linear_cross_entropy_loss(
        hidden.reshape(-1, hidden.shape[-1]),
        shift_labels.reshape(-1).to(hidden.device),
        weight,
        ignore_index=IGNORE_INDEX,
        reduction=reduction,
    )
    if num_items_in_batch is not None:
        loss = loss / (
            num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
        )
    return loss


__all__ = ["causal_lm_loss_fla", "kernel"]
