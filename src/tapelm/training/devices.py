"""Which device a process computes on.

Training goes through accelerate, which places the model (each process on its own GPU under a multi-GPU launch).
Everything else that runs a model — `tapelm eval`, the evaluations of `finetune` and `extend`, SCROLLS predictions,
the benchmarks — asks `process_device()`, the device accelerate would choose, so that the same command computes on
the GPU of its process, or on the CPU where there is none, and moves its inputs to the model's device.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def process_device() -> torch.device:
    """This process's device as accelerate decides it: cuda:LOCAL_RANK under a multi-GPU launch, the GPU (or MPS,
    XPU, ...) when there is one, else the CPU; `ACCELERATE_TORCH_DEVICE` overrides it."""
    from accelerate import PartialState

    return PartialState().device


def describe_device(device: torch.device) -> dict[str, Any]:
    """What result.json records of the device a run computed on: its name in the process, the accelerator's model
    name (CUDA) and the GPUs the process was given (CUDA_VISIBLE_DEVICES, as a launcher pinned it)."""
    device = torch.device(device)
    return {
        "device": str(device),
        "name": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of `model`'s parameters."""
    return next(model.parameters()).device


__all__ = ["describe_device", "model_device", "process_device"]
