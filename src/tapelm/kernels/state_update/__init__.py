"""TAPE's two updates of the positional state in one layer (the attention branch's head mixing and the MLP branch's
per-token maps, each with its residual sum): the reference (`naive`) and Triton kernels ("state-update-triton", one
program per token for both, forward and backward). Without them the attention branch runs the reference and the MLP
branch `tapelm.kernels.state_mixing`'s dispatcher."""

from __future__ import annotations

import torch

from ...fast_paths import FastPaths
from .. import candidates, first, triton_takes
from ..state_mixing import mix_state
from .naive import add_attended, in_dtype, update_state_reference


def _triton(state, attended, attn_mix, mix):
    """Over a sequence (a decoding step's token is a few calls on the reference path)."""
    if state.shape[-2] == 1 or not (triton_takes(state) and triton_takes(attended)):
        return None
    from .triton import update_state_triton

    return update_state_triton(state, attended, attn_mix, mix)


CANDIDATES = candidates("state-update", ("triton", _triton))


def update_state(
    state: torch.Tensor, attended: torch.Tensor, attn_mix: torch.Tensor, mix: torch.Tensor | None, paths: FastPaths
) -> torch.Tensor:
    """`naive.update_state_reference(state, attended, attn_mix, mix)` by the first candidate that is on in `paths`
    and takes the call, else the attention branch's reference and the MLP branch's dispatcher."""
    out = first(CANDIDATES, paths, state, attended, attn_mix, mix)
    if out is not None:
        return out
    state = add_attended(state, attended, attn_mix)
    return state if mix is None else mix_state(state, mix, paths)


__all__ = ["CANDIDATES", "add_attended", "in_dtype", "update_state", "update_state_reference"]
