"""Each fast path's first call (`tapelm doctor`'s first-calls part): what a path costs before it runs at speed, its
kernels compiled and fla's autotuned (or read from Triton's cache on disk), and whether decoding tunes again.

A small model (heads of 64, 512 tokens: shapes every path takes, PaTH's fla kernel included) with one path on, after
one reference step has paid for what every path shares (CUDA's and cuBLAS's start): the seconds of its first and
second training step, whether the path ran, how many kernels Triton autotuned and for how long (its autotuning
listener), and the autotunings in a second `generate` at another prompt and decode length (none, when tuning keys
hold no length). Paths run one after another in this process, each after the ones before it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

from ..config import TapeConfig
from ..fast_paths import NAMES, recording
from ..modeling import TapeForCausalLM

ENCODING = {
    "attention-blocks": "t5",
    "attention-efficient": "fire",
    "forgetting-attention-fla": "fox",
    "path-attention-fla": "path",
    "wall-attention-fla": "wall",
    "stickbreaking-attention-fla": "stickbreaking",
    "rotation-fla": "rope",
    "norm-fla": "rope",
    "mlp-fla": "rope",
    "loss-fla": "rope",
}
"""The encoding each path is timed on: one it runs for (TAPE for the others: rotation, state and TAPE's attention)."""
SHAPES = {
    False: {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2, "tokens": 512},
    True: {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2, "tokens": 32},
}
"""The model's width and heads, and the tokens of a training step; `tiny` (True) for the CPU."""


def run_first_calls(device: torch.device, tiny: bool, progress: Callable[[dict], None] = lambda partial: None) -> dict:
    """Every fast path's first call on `device` (module docstring), handed to `progress` after each path."""
    tunings: list[dict] = []
    paths: dict[str, dict] = {}
    with _listening(tunings):
        _step(_model("tape", "off", device, tiny), device, tiny)
        for path in NAMES:
            try:
                paths[path] = _first_call(path, device, tiny, tunings)
            except Exception as error:  # a path that fails is recorded; the others still run
                paths[path] = {"error": f"{type(error).__name__}: {error}"[:500]}
            progress({"paths": paths})
    failed = [path for path, result in paths.items() if "error" in result or result.get("retuned_in_generate")]
    return {
        "status": "failed" if failed else "passed",
        "paths": paths,
        "autotune_listener": _listener() is not None,
        **({"failed": failed} if failed else {}),
    }


def _first_call(path: str, device: torch.device, tiny: bool, tunings: list[dict]) -> dict:
    encoding = ENCODING.get(path, "tape")
    model = _model(encoding, [path], device, tiny)
    result = {"encoding": encoding}
    for name in ("first_step", "second_step"):
        before = len(tunings)
        with recording() as ran:
            result[f"{name}_seconds"] = _step(model, device, tiny)
        result["ran"] = result.get("ran", False) or path in ran
        result[f"{name}_autotunings"] = len(tunings) - before
        result[f"{name}_autotune_seconds"] = sum(t["seconds"] or 0.0 for t in tunings[before:])
    model.eval()
    _generate(model, device, prompt=16, new_tokens=8)
    before = len(tunings)
    result["second_generate_seconds"] = _generate(model, device, prompt=23, new_tokens=13)
    result["retuned_in_generate"] = [t["kernel"] for t in tunings[before:]]
    return result


def _model(encoding: str, setting, device: torch.device, tiny: bool) -> TapeForCausalLM:
    shape = {key: value for key, value in SHAPES[tiny].items() if key != "tokens"}
    config = TapeConfig(
        vocab_size=256,
        intermediate_size=2 * shape["hidden_size"],
        num_hidden_layers=2,
        max_position_embeddings=1024,
        pe_type=encoding,
        fast_paths=setting,
        **shape,
    )
    torch.manual_seed(0)
    return TapeForCausalLM(config).to(device).train()


def _step(model: TapeForCausalLM, device: torch.device, tiny: bool) -> float:
    """The seconds of one training step (forward with labels, backward), bf16 autocast on CUDA."""
    ids = torch.randint(0, 256, (1, SHAPES[tiny]["tokens"]), generator=torch.Generator().manual_seed(0)).to(device)
    _synchronize(device)
    started = time.perf_counter()
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        model(ids, labels=ids).loss.backward()
    _synchronize(device)
    return time.perf_counter() - started


@torch.no_grad()
def _generate(model: TapeForCausalLM, device: torch.device, prompt: int, new_tokens: int) -> float:
    ids = torch.randint(0, 256, (1, prompt), generator=torch.Generator().manual_seed(1)).to(device)
    _synchronize(device)
    started = time.perf_counter()
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    _synchronize(device)
    return time.perf_counter() - started


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _listener():
    """Triton's autotuning settings (`triton.knobs.autotuning`, whose `listener` sees each tuning), or None without
    Triton."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs.autotuning if hasattr(knobs.autotuning, "listener") else None


@contextlib.contextmanager
def _listening(tunings: list[dict]) -> Iterator[None]:
    """Append each kernel Triton tunes (not read from its cache) inside the block to `tunings`."""
    settings = _listener()
    if settings is None:
        yield
        return
    previous = settings.listener

    def heard(fn, key, best_config, configs_timings, duration, cache_hit):
        if not cache_hit:
            tunings.append({"kernel": fn.__name__, "key": str(key), "seconds": duration})

    settings.listener = heard
    try:
        yield
    finally:
        settings.listener = previous


__all__ = ["ENCODING", "run_first_calls"]
