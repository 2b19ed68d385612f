"""TAPE's MLP-branch update of the positional state, E_g <- E_g + sum_h M_gh E_h with one Hkv x Hkv map M per
token: the plain PyTorch reference (`naive`) and Triton kernels (`fused`, fast path "fused-state-mixing": CUDA with
Triton, off until a GPU run passes)."""

from __future__ import annotations

import torch

from ...fast_paths import enabled
from .. import triton_takes
from .naive import fused_when_compiled, mix_state_reference, plus_product, state_delta


def mix_state(state: torch.Tensor, mix: torch.Tensor, fast_paths: str = "auto") -> torch.Tensor:
    """`mix_state_reference`, through the kernels where the fast path is on and they take the state (CUDA, half or
    single precision; not while compiling: the compiler fuses the reference itself)."""
    if (enabled("fused-state-mixing", state.device, fast_paths) and triton_takes(state)
            and not torch.compiler.is_compiling()):
        from .fused import mix_state_fused

        return mix_state_fused(state, mix)
    return mix_state_reference(state, mix)


__all__ = ["fused_when_compiled", "mix_state", "mix_state_reference", "plus_product", "state_delta"]
