"""Adapters to kernels that other libraries maintain, each beside tapelm's own reference path."""

from __future__ import annotations

import importlib.util

import torch


def fla_runs_on(device: torch.device) -> bool:
    """Whether fla's Triton kernels can run on `device`: CUDA, with fla installed (`pip install tapelm[gpu]`)."""
    return device.type == "cuda" and importlib.util.find_spec("fla") is not None


def triton_runs_on(device: torch.device) -> bool:
    """Whether tapelm's own Triton kernels can run on `device`: CUDA, with Triton installed."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None
