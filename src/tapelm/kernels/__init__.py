"""Adapters to kernels that other libraries maintain, each beside tapelm's own reference path."""

from __future__ import annotations

import importlib.util

import torch


KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""The dtypes the Triton kernels take: they compute in float32, so a float64 tensor stays on the reference path, which
keeps its precision."""


def fla_runs_on(device: torch.device) -> bool:
    """Whether fla's Triton kernels can run on `device`: CUDA, with fla installed (`pip install tapelm[gpu]`)."""
    return _cuda_with(device, "fla")


def fla_takes(x: torch.Tensor) -> bool:
    """Whether fla's kernels take `x`: on a device they run on, in one of `KERNEL_DTYPES`."""
    return x.dtype in KERNEL_DTYPES and fla_runs_on(x.device)


def triton_takes(x: torch.Tensor) -> bool:
    """Whether tapelm's own Triton kernels take `x`: on CUDA with Triton installed, in one of `KERNEL_DTYPES`."""
    return x.dtype in KERNEL_DTYPES and _cuda_with(x.device, "triton")


def _cuda_with(device: torch.device, package: str) -> bool:
    return device.type == "cuda" and importlib.util.find_spec(package) is not None
