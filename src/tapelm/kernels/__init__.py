"""Every operation that has a fast path, one folder each: `naive.py` is the plain PyTorch reference, each other file
one implementation (tapelm's own Triton kernels, fla's, PyTorch's), and `__init__.py` the operation's one dispatcher,
which holds its ordered candidates (`Candidate`, named as in `tapelm.fast_paths`) and runs the first that is on and
takes the call, else the reference.

Operations: attention (the decoder's attention call), rotation (q and k by RoPE's tables or TAPE's state),
state_mixing (TAPE's MLP-branch update), forgetting_attention (FoX), path_attention (PaTH), wall_attention (Wall),
norm, mlp and loss (the shared parts of every decoder)."""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..fast_paths import BY_NAME, FastPaths, note

FLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""The dtypes fla's kernels take: they compute in float32, so a float64 tensor stays on the reference path, which
keeps its precision."""


@dataclass(frozen=True)
class Candidate:
    """One implementation of an operation: `run(*args)` computes the operation's result, or returns None where it
    does not take the call (device, dtype, shapes, a library missing)."""

    path: str
    run: Callable


def candidates(operation: str, *implementations: tuple[str, Callable]) -> tuple[Candidate, ...]:
    """The ordered candidates of `operation`, each (implementation, run); a name missing from `tapelm.fast_paths`
    fails here, when the dispatcher is imported."""
    found = []
    for implementation, run in implementations:
        name = f"{operation}-{implementation}"
        if name not in BY_NAME:
            raise ImportError(f"tapelm.kernels: the candidate {name!r} is not a fast path in tapelm.fast_paths")
        found.append(Candidate(name, run))
    return tuple(found)


def first(options: tuple[Candidate, ...], paths: FastPaths, *args):
    """The result of the first candidate that is on in `paths` and takes the call, or None."""
    for candidate in options:
        if candidate.path in paths:
            result = candidate.run(*args)
            if result is not None:
                note(candidate.path)
                return result
    return None


def fla_runs_on(device: torch.device) -> bool:
    """Whether fla's Triton kernels can run on `device`: CUDA, with fla installed (`pip install tapelm[gpu]`)."""
    return device.type == "cuda" and _installed("fla")


def fla_takes(x: torch.Tensor) -> bool:
    """Whether fla's kernels take `x`: on a device they run on, in one of `FLA_DTYPES`."""
    return x.dtype in FLA_DTYPES and fla_runs_on(x.device)


def fla_function(x: torch.Tensor, module: str, name: str):
    """fla's function `module.name` for tensors like `x` (imported on first use, its autotuning bounded), or None
    where fla does not run."""
    return getattr(_fla_module(module), name) if fla_takes(x) else None


AUTOTUNE_CONFIGS = 4
"""The most configurations one of fla's autotuned kernels benchmarks at a new tuning key. fla 0.6's lists hold up to 48
(block sizes x num_warps x num_stages), each a compile and a benchmark at the first call: with every fast path on,
the first training step of a tiny model waited minutes for them (docs/GPU.md, "The first call"). Triton keeps the
winner on disk per GPU architecture (fla passes `cache_results`), so a second process reads it."""


@functools.cache
def _fla_module(module: str):
    """fla's `module`, imported, and the autotuning of every fla kernel loaded so far bounded."""
    imported = importlib.import_module(module)
    bound_fla_autotuning()
    return imported


def bound_fla_autotuning() -> list:
    """Keep at most `AUTOTUNE_CONFIGS` of each loaded fla kernel's autotuning configurations, spread evenly over its
    list (its first and last among them); the kernels' autotuners, each with `listed_configs`, the count fla lists."""
    import sys

    from triton.runtime.autotuner import Autotuner

    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for value in vars(module).values():
            for _ in range(4):  # heuristics and jit wrap the autotuner: follow `.fn`
                if isinstance(value, Autotuner):
                    found[id(value)] = value
                    break
                value = getattr(value, "fn", None)
    for tuner in found.values():
        count = len(tuner.configs)
        tuner.listed_configs = getattr(tuner, "listed_configs", count)
        if count > AUTOTUNE_CONFIGS:
            keep = sorted({round(i * (count - 1) / (AUTOTUNE_CONFIGS - 1)) for i in range(AUTOTUNE_CONFIGS)})
            tuner.configs = [tuner.configs[i] for i in keep]
    return list(found.values())


def triton_takes(x: torch.Tensor) -> bool:
    """Whether tapelm's own Triton kernels take `x`: floating point, on CUDA with Triton installed, or on the CPU
    under Triton's interpreter (`TRITON_INTERPRET=1`, how CI runs them). They accumulate in float32, in float64 for
    float64 inputs."""
    device = x.device.type
    if device != "cuda" and not (device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    return x.is_floating_point() and _installed("triton") and not torch.compiler.is_compiling()


@functools.cache
def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


__all__ = [
    "AUTOTUNE_CONFIGS",
    "FLA_DTYPES",
    "Candidate",
    "bound_fla_autotuning",
    "candidates",
    "first",
    "fla_function",
    "fla_runs_on",
    "fla_takes",
    "triton_takes",
]
