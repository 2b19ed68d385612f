"""The fast paths and where they run by default.

A fast path computes exactly the function of a plain PyTorch reference path (the tests hold each to its reference:
forward and every gradient in float64 on the CPU, within bf16 tolerance on a device). It runs by default
(`TapeConfig.fast_paths="auto"`) only on the device types where `pytest --device ...` has passed with it on, as
recorded under docs/gpu/; `fast_paths="on"` runs it wherever the device offers it, `"off"` never.
"""

from __future__ import annotations

import torch

VERIFIED: dict[str, tuple[str, ...]] = {
    # SDPA's CPU flash kernel for a value stream wider than q and k (tapelm.attention.CpuFlashAttention), keeping
    # only the unpadded q and k for the backward pass, which in float32 and float64 is plain matrix products over
    # blocks of queries at q's width (tapelm.attention.stream_attention_backward)
    "cpu-flash-attention": ("cpu",),
    # attention without zero-padding q and k, on the CUDA kernels that take a wider value (cuDNN, memory-efficient):
    # not yet run under `pytest --device cuda`
    "cuda-unpadded-attention": (),
    # the rotation of q and k by RoPE's tables or TAPE's state as an autograd function with a hand-written backward
    # (tapelm.kernels.rotation.HalvesRotation): plain PyTorch, run under `pytest --device cuda` not yet
    "fused-rotation": ("cpu",),
    # the same rotation as Triton kernels, the angles' gradient summed over a query group in the same pass
    # (tapelm.kernels.rotation.fused): CUDA with Triton, not yet run under `pytest --device cuda`
    "triton-rotation": (),
    # attention over blocks of queries with a bias built per block inside activation checkpoints
    # (tapelm.attention.chunked_bias_attention): plain PyTorch, run under `pytest --device cuda` not yet
    "chunked-bias-attention": ("cpu",),
    # FoX and PaTH through fla's kernels where fla is installed (tapelm.kernels.fla): CUDA only, not yet run under
    # `pytest --device cuda`
    "fla-kernels": (),
    # the rotary embedding, RMSNorm, SwiGLU and the output projection with the cross-entropy through fla's kernels
    # (tapelm.kernels.fused): CUDA only, not yet run under `pytest --device cuda`
    "fused-modules": (),
    # TAPE's MLP-branch update of the state, one Triton program per token (tapelm.kernels.state_mixing): CUDA with
    # Triton, not yet run under `pytest --device cuda`
    "fused-state-mixing": (),
}


def enabled(name: str, device: torch.device, setting: str) -> bool:
    """Whether fast path `name` runs on `device` under the config's `fast_paths` setting."""
    if setting == "off":
        return False
    return setting == "on" or device.type in VERIFIED[name]


__all__ = ["VERIFIED", "enabled"]
