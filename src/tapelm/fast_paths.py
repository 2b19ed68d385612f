"""The fast paths: every kernel or formulation that computes the function of a plain PyTorch reference, by name
(`<operation>-<implementation>`, the operation being a folder of `tapelm.kernels`), and where each runs by default.

A forward pass resolves the config's `fast_paths` once (`resolve`) into the frozen set of path names on for its device
and encoding, and hands it down through `PositionContext.paths` to every dispatcher (`tapelm.kernels.<op>`), which
tries its candidates in order. "auto" (the default) turns on the paths whose law tests passed on that device type
(`pytest --device ...`, recorded under docs/gpu/), "on" every path, "off" none, and a list of names exactly those.
A path that is on still runs only where its kernel takes the call (device, dtype, shapes, installed libraries).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

SETTINGS = ("auto", "on", "off")
EVERY_ENCODING = None


@dataclass(frozen=True)
class FastPath:
    """One implementation of one operation. `verified` maps a device type to the encodings (`pe_type`s) whose law
    tests passed there with the path on, or to `EVERY_ENCODING`; "auto" runs it there for those."""

    operation: str
    implementation: str
    summary: str
    verified: dict[str, tuple[str, ...] | None] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.operation}-{self.implementation}"

    def verified_for(self, device_type: str, encoding: str) -> bool:
        if device_type not in self.verified:
            return False
        encodings = self.verified[device_type]
        return encodings is EVERY_ENCODING or encoding in encodings


H200 = "docs/gpu/h200-2026-11-27"
"""The GPU record that verified the CUDA entries below (`pytest --device cuda -m device`, all of them passed)."""

PATHS: tuple[FastPath, ...] = (
    FastPath(
        "attention",
        "blocks",
        "a bias built per block of queries inside activation checkpoints, so no N x T tensor per head is kept "
        "(kernels/attention/blocks.py); on CUDA verified for every encoding but FIRE, whose gradients missed the "
        "accuracy rule there",
        {"cpu": EVERY_ENCODING, "cuda": ("alibi", "t5", "cope", "fox", "path")},
    ),
    FastPath(
        "attention",
        "efficient",
        "a bias that needs a gradient (T5, FIRE, CoPE, FoX, PaTH) as SDPA's float mask on CUDA's "
        "memory-efficient kernel, which computes the mask's gradient itself (kernels/attention/efficient.py)",
    ),
    FastPath(
        "attention",
        "cpu-flash",
        "SDPA's CPU flash kernel for a value stream wider than q and k, keeping only the unpadded q and k for a "
        "backward pass of plain products over blocks of queries (kernels/attention/cpu_flash.py)",
        {"cpu": EVERY_ENCODING},
    ),
    FastPath(
        "attention",
        "unpadded",
        "a value wider than q and k without zero-padding them, on CUDA's kernels that take it: cuDNN (training) "
        "or memory-efficient (kernels/attention/unpadded.py)",
        {"cuda": EVERY_ENCODING},
    ),
    FastPath(
        "rotation",
        "triton",
        "the rotation of q and k by RoPE's tables or TAPE's state as Triton kernels, the state's gradient summed "
        "over a query group in the same pass (kernels/rotation/triton.py)",
        {"cuda": EVERY_ENCODING},
    ),
    FastPath(
        "rotation",
        "fla",
        "RoPE's rotation through fla's rotary kernel, in passes with gradients (kernels/rotation/fla.py)",
    ),
    FastPath(
        "rotation",
        "autograd",
        "the rotation as an autograd function with a hand-written backward (kernels/rotation/autograd.py)",
        {"cpu": EVERY_ENCODING, "cuda": EVERY_ENCODING},
    ),
    FastPath(
        "state-update",
        "triton",
        "TAPE's two updates of the state in a layer (the attention branch's head mixing and the MLP branch's "
        "per-token maps, with their residual sums) as one Triton program per token, forward and backward "
        "(kernels/state_update/triton.py)",
    ),
    FastPath(
        "state-mixing",
        "triton",
        "TAPE's MLP-branch update of the state, one Triton program per token (kernels/state_mixing/triton.py)",
        {"cuda": EVERY_ENCODING},
    ),
    FastPath(
        "forgetting-attention", "fla", "FoX's attention through fla's kernel (kernels/forgetting_attention/fla.py)"
    ),
    FastPath(
        "path-attention",
        "fla",
        "PaTH's attention through fla's kernel, within fla's tested shapes (kernels/path_attention/fla.py)",
    ),
    FastPath(
        "wall-attention",
        "fla",
        "Wall attention through fla's kernels: the parallel one without cached keys, the decode one over cached keys "
        "(kernels/wall_attention/fla.py)",
    ),
    FastPath(
        "wall-attention",
        "anchored",
        "Wall attention as plain attention between queries and keys scaled from one anchor per row (the decoder's "
        "attention function and its fast paths), where the cumulative gates span at most 60 (float32) per channel "
        "(kernels/wall_attention/anchored.py)",
        {"cpu": EVERY_ENCODING},
    ),
    FastPath(
        "stickbreaking-attention",
        "fla",
        "stick-breaking attention through fla's kernel (kernels/stickbreaking_attention/fla.py)",
    ),
    FastPath(
        "stickbreaking-attention",
        "autograd",
        "stick-breaking attention over a sequence in fewer passes over the N x T weights, in place, as an autograd "
        "function that keeps only the weights for its backward (kernels/stickbreaking_attention/autograd.py)",
        {"cpu": EVERY_ENCODING},
    ),
    FastPath("norm", "fla", "RMSNorm through fla's kernel, in passes with gradients (kernels/norm/fla.py)"),
    FastPath("mlp", "fla", "the SwiGLU product through fla's kernel, in passes with gradients (kernels/mlp/fla.py)"),
    FastPath(
        "loss",
        "fla",
        "the output projection and the cross-entropy through fla's fused kernel, no logits made, in training "
        "with labels (kernels/loss/fla.py)",
    ),
)
"""In the order each operation tries them."""
BY_NAME: dict[str, FastPath] = {path.name: path for path in PATHS}
NAMES: tuple[str, ...] = tuple(BY_NAME)
assert len(NAMES) == len(PATHS), "two fast paths share a name"

FastPaths = frozenset
"""The resolved setting of one forward pass: the names of the paths that are on (a `frozenset[str]`)."""
NONE: FastPaths = frozenset()


def check_setting(setting) -> None:
    """Raise ValueError unless `setting` is one of `SETTINGS` or a list of known path names."""
    allowed = f"choose one of: {', '.join(SETTINGS)}, or a list of fast path names ({', '.join(NAMES)})"
    if isinstance(setting, str):
        if setting not in SETTINGS:
            raise ValueError(f"fast_paths={setting!r} is not allowed; {allowed}")
        return
    if not isinstance(setting, Sequence) or not all(isinstance(name, str) for name in setting):
        raise ValueError(f"fast_paths={setting!r} is not allowed; {allowed}")
    unknown = [name for name in setting if name not in BY_NAME]
    if unknown:
        raise ValueError(f"fast_paths names unknown fast path(s) {', '.join(unknown)}; {allowed}")


def resolve(setting, device: torch.device, encodings: str | tuple[str, ...]) -> FastPaths:
    """The paths on for one forward pass on `device` under the config's `setting`, of a model whose layers use
    `encodings` (a `pe_type`, or those of a per-layer schedule: "auto" turns on what is verified for all)."""
    key = setting if isinstance(setting, str) else tuple(setting)
    encodings = (encodings,) if isinstance(encodings, str) else encodings
    if torch.compiler.is_compiling():  # traced as constants; the compiler guards on the setting itself
        return _resolve(key, device.type, encodings)
    return _cached_resolve(key, device.type, encodings)


def _resolve(setting: str | tuple[str, ...], device_type: str, encodings: tuple[str, ...]) -> FastPaths:
    if setting == "off":
        return NONE
    if setting == "on":
        return frozenset(NAMES)
    if setting == "auto":
        return frozenset(path.name for path in PATHS if all(path.verified_for(device_type, name) for name in encodings))
    check_setting(setting)
    return frozenset(setting)


_cached_resolve = functools.lru_cache(maxsize=None)(_resolve)
"""The same object for the same setting: torch.compile's guards on a compiled layer's inputs then hold."""


_ran: list[set[str]] = []


@contextlib.contextmanager
def recording() -> Iterator[set[str]]:
    """A set that collects the name of every fast path that computed a result inside the block (eager code only:
    nothing is recorded while torch.compile traces)."""
    names: set[str] = set()
    _ran.append(names)
    try:
        yield names
    finally:
        _ran.remove(names)


def note(name: str) -> None:
    """Record that fast path `name` computed a result (see `recording`)."""
    if _ran and not torch.compiler.is_compiling():
        for names in _ran:
            names.add(name)


__all__ = ["BY_NAME", "NAMES", "PATHS", "SETTINGS", "FastPath", "FastPaths", "check_setting", "recording", "resolve"]
