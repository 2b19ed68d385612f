"""The shared parts of every decoder, fused by fla's kernels on CUDA: the rotary embedding, RMSNorm, the SwiGLU
product, and the output projection with the cross-entropy (no full logits tensor is made or kept).

The reference is plain PyTorch: tapelm's `kernels.rotation.rotate_halves`, transformers' `LlamaRMSNorm`,
`LlamaMLP` and causal-LM loss. The modules below keep their parameters (same state_dict names and shapes) and run
fla's kernels where the fast path "fused-modules" is on (`tapelm.fast_paths`; CUDA only, off until a GPU run passes)
and fla is installed (`pip install tapelm[gpu]`), in passes with gradients (training). The fused loss keeps the
model's loss semantics: the label shift, `ignore_index`, and the sum divided by `num_items_in_batch` under gradient
accumulation. While training with labels it returns no logits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from ..fast_paths import enabled
from . import fla_takes

IGNORE_INDEX = -100


@dataclass(frozen=True)
class FusedOps:
    """`rms_norm(x, weight, eps)`, `swiglu(gate, up)` = silu(gate) * up,
    `linear_cross_entropy(hidden (M, D), weight (V, D), targets (M,), reduction)` -> float32 loss, and
    `rotary(x (B, H, N, d), cos, sin)` with per-token tables (B or 1, 1, N, d/2), one per rotate-half pair."""

    rms_norm: Callable[..., torch.Tensor]
    swiglu: Callable[..., torch.Tensor]
    linear_cross_entropy: Callable[..., torch.Tensor]
    rotary: Callable[..., torch.Tensor]


def operations(x: torch.Tensor) -> FusedOps | None:
    """fla's fused kernels for tensors like `x`: on CUDA with fla installed, in half or single precision; else None
    (the reference runs)."""
    return _kernels() if fla_takes(x) else None


@functools.cache
def _kernels() -> FusedOps:
    from fla.modules.activations import swiglu
    from fla.modules.fused_linear_cross_entropy import fused_linear_cross_entropy_loss
    from fla.modules.norm.layernorm import rms_norm
    from fla.modules.rotary import rotary_embedding

    def norm(x, weight, eps):
        return rms_norm(x, weight, None, eps=eps)

    def linear_cross_entropy(hidden, weight, targets, reduction):
        return fused_linear_cross_entropy_loss(hidden, targets, weight, ignore_index=IGNORE_INDEX, reduction=reduction)

    def rotary(x, cos, sin):
        # fla's kernel reads a table row per position, offset per sequence: sequence b's rows start at b * N of the
        # flattened per-token tables, so any positions (packing, RandPE, left padding) rotate as in the reference
        batch, _, length, dim = x.shape

        def rows(table):
            return table.expand(batch, 1, length, dim // 2).reshape(batch * length, -1).to(x.dtype)

        offsets = torch.arange(batch, device=x.device) * length
        return rotary_embedding(x.transpose(1, 2), rows(cos), rows(sin), seqlen_offsets=offsets).transpose(1, 2)

    return FusedOps(norm, swiglu, linear_cross_entropy, rotary)


def fused_operations(x: torch.Tensor, setting: str) -> FusedOps | None:
    """The fused kernels for `x` under the config's `fast_paths` setting in a pass with gradients, or None. Without
    gradients (prefill, decoding) the reference runs: there, on the H100, fla's kernels made RoPE's eager prefill 1.9x
    and its decoding 1.6x slower (docs/gpu/h100-2026-11-26-b/)."""
    if not torch.is_grad_enabled():
        return None
    return operations(x) if enabled("fused-modules", x.device, setting) else None


class RMSNorm(LlamaRMSNorm):
    """transformers' Llama RMSNorm, through fla's kernel where the fast path is on (read from the config at every
    call)."""

    def __init__(self, config):
        super().__init__(config.hidden_size, eps=config.rms_norm_eps)
        self.config = config

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        ops = fused_operations(hidden_states, self.config.fast_paths)
        if ops is None:
            return super().forward(hidden_states)
        return ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)


class MLP(LlamaMLP):
    """transformers' Llama SwiGLU MLP, its product silu(gate) * up through fla's kernel where the fast path is on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_operations(x, self.config.fast_paths)  # the config's activation is SiLU
        if ops is None:
            return super().forward(x)
        return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x)))


def causal_lm_loss(ops: FusedOps, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                   num_items_in_batch=None, shift_labels: torch.Tensor | None = None, **_) -> torch.Tensor:
    """transformers' causal-LM loss of the logits hidden @ weight^T, without making them: token t predicts label
    t + 1 (or `shift_labels[t]`), `IGNORE_INDEX` labels count for nothing, the mean over the counted tokens or the
    sum over `num_items_in_batch`."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = ops.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight,
                                    shift_labels.reshape(-1).to(hidden.device), reduction)
    if num_items_in_batch is not None:
        loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch)
                       else num_items_in_batch)
    return loss


__all__ = ["MLP", "FusedOps", "RMSNorm", "causal_lm_loss", "fused_operations", "operations"]
