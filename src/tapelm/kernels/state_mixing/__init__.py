"""TAPE's MLP-branch update of the positional state, E_g <- E_g + sum_h M_gh E_h with one Hkv x Hkv map M per
token: the plain PyTorch reference (`naive`) and Triton kernels ("state-mixing-triton")."""

from __future__ import annotations

import torch

from ...fast_paths import FastPaths
from .. import candidates, first, triton_takes
from .naive import fused_when_compiled, mix_state_reference, plus_product, state_delta


def _triton(state, mix):
    """Over a sequence: a decoding step's token is one `baddbmm` on the reference path, fewer launches than a Triton
    kernel's (with it on, TAPE's eager batch-1 decoding was 1.51x RoPE's time against 1.44x without, on an H200)."""
    if state.shape[-2] == 1 or not triton_takes(state):
        return None
    from .triton import mix_state_triton

    return mix_state_triton(state, mix)


CANDIDATES = candidates("state-mixing", ("triton", _triton))


def mix_state(state: torch.Tensor, mix: torch.Tensor, paths: FastPaths) -> torch.Tensor:
    """`mix_state_reference(state, mix)` by the first candidate that is on in `paths` and takes the call."""
    out = first(CANDIDATES, paths, state, mix)
    return mix_state_reference(state, mix) if out is None else out


__all__ = ["CANDIDATES", "fused_when_compiled", "mix_state", "mix_state_reference", "plus_product", "state_delta"]
