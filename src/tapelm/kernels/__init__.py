"""Adapters to kernels that other libraries maintain, each beside tapelm's own reference path."""

from __future__ import annotations

import importlib.util

import torch


def fla_runs_on(device: torch.device) -> bool:
    """Whether fla's Triton kernels can run on `device`: CUDA, with fla installed (`pip install tapelm[gpu]`)."""
    return _cuda_with(device, "fla")


def triton_runs_on(device: torch.device) -> bool:
    """Whether tapelm's own Triton kernels can run on `device`: CUDA, with Triton installed."""
    return _cuda_with(device, "triton")


def _cuda_with(device: torch.device, package: str) -> bool:
    return device.type == "cuda" and importlib.util.find_spec(package) is not None
