"""The SwiGLU product silu(gate) * up of the decoder's MLP: the reference (`naive`) and fla's kernel ("mlp-fla", in
passes with gradients)."""

from __future__ import annotations

import torch

from ...fast_paths import FastPaths
from .. import candidates, first
from .naive import swiglu as swiglu_reference


def _fla(gate, up):
    from .fla import swiglu_fla

    return swiglu_fla(gate, up)


CANDIDATES = candidates("mlp", ("fla", _fla))


def swiglu(gate: torch.Tensor, up: torch.Tensor, paths: FastPaths) -> torch.Tensor:
    """silu(gate) * up by the first candidate that is on in `paths` and takes the call."""
    out = first(CANDIDATES, paths, gate, up)
    return swiglu_reference(gate, up) if out is None else out


__all__ = ["CANDIDATES", "swiglu", "swiglu_reference"]
