"""RMSNorm: the reference (`naive`, transformers' Llama RMSNorm) and fla's kernel ("norm-fla", in passes with
gradients: without them, prefill and decoding, the reference was faster on an H100, docs/gpu/h100-2026-11-26-b/)."""

from __future__ import annotations

import torch

from ...fast_paths import FastPaths
from .. import candidates, first
from .naive import rms_norm as rms_norm_reference


def _fla(x, weight, eps):
    from .fla import rms_norm_fla

    return rms_norm_fla(x, weight, eps)


CANDIDATES = candidates("norm", ("fla", _fla))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, paths: FastPaths) -> torch.Tensor:
    """`naive.rms_norm(x, weight, eps)` by the first candidate that is on in `paths` and takes the call."""
    out = first(CANDIDATES, paths, x, weight, eps)
    return rms_norm_reference(x, weight, eps) if out is None else out


__all__ = ["CANDIDATES", "rms_norm", "rms_norm_reference"]
