"""The reference SwiGLU product of transformers' Llama MLP: silu(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


__all__ = ["swiglu"]
