"""How a fast path is held to its reference path (test_fast_paths, test_fla, test_state_mixing, test_rotation_kernels).

In float64 (on the CPU) the two paths agree to `exact` of each tensor's largest entry. On a device, where the kernels
take half precision, the fast path's error from the reference path in float64 may be at most `FACTOR` times the
reference path's own error in that precision, plus one rounding step, both errors and the step measured over the
whole tensor (its Euclidean norm): a kernel is held to the precision a user would get without it, not to a fixed
tolerance that a few layers of bf16 rounding already exceed. The norm, not the largest entry: two ways of rounding
differ entry by entry, and their largest errors by more than 2x on a GPU (docs/gpu/h100-2026-11-27/), while a wrong
result moves the whole tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FACTOR = 2.0
ROUNDING = {torch.float64: 0.0, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
"""Half the spacing of each dtype's numbers near 1, relative."""

Outputs = dict[str, "torch.Tensor | None"]


def outputs(model: torch.nn.Module, **named: torch.Tensor | None) -> Outputs:
    """The named tensors of one pass (detached) and every parameter's gradient."""
    return {**{name: None if value is None else value.detach() for name, value in named.items()},
            **{f"grad {name}": param.grad for name, param in model.named_parameters()}}


def compare_paths(run: Callable[[str, torch.dtype], Outputs], dtype: torch.dtype, exact: float = 1e-12) -> None:
    """`run(setting, dtype)` gives the named tensors of one pass with `fast_paths=setting` in `dtype`: those of "on"
    in `dtype` against "off" in float64, each to `exact` of its largest entry in float64, else by the rule above."""
    truth = run("off", torch.float64)
    actual = run("on", dtype)
    baseline = None if dtype == torch.float64 else run("off", dtype)
    assert actual.keys() == truth.keys()
    for name, expected in truth.items():
        assert (actual[name] is None) == (expected is None), name
        if expected is None:
            continue
        expected = expected.double()
        if baseline is None:
            scale = expected.abs().max().item()
            error = (actual[name].double() - expected).abs().max().item()
            allowed = exact * max(scale, 1.0)
            what = "largest error", "largest entry"
        else:
            scale = expected.norm().item()
            error = (actual[name].double() - expected).norm().item()
            allowed = FACTOR * (baseline[name].double() - expected).norm().item() + ROUNDING[dtype] * scale
            what = "error (norm)", "norm"
        assert error <= allowed, (f"{name}: {what[0]} {error:.3g} from the float64 reference, allowed {allowed:.3g}"
                                  f" ({what[1]} {scale:.3g})")


def compare_models_through_path(path: str, encodings: tuple[str, ...], device, dtype: torch.dtype) -> None:
    """Tiny models of `encodings` with fast path `path` alone (`fast_paths=[path]`) against the reference paths: the
    loss and every parameter's gradient (`compare_paths`); the path must have run. On the CPU tapelm's Triton kernels
    run under Triton's interpreter (`TRITON_INTERPRET=1`)."""
    from conftest import tiny_model, tokens
    from tapelm import fast_paths

    ids = tokens(2, 9).to(device)
    for encoding in encodings:
        def run(setting, setting_dtype, encoding=encoding):
            model = tiny_model(encoding, dtype=setting_dtype, fast_paths=[path] if setting == "on" else []).to(device)
            with fast_paths.recording() as ran:
                loss = model.train()(ids, labels=ids).loss
                loss.backward()
            assert ran == ({path} if setting == "on" else set()), (encoding, setting, ran)
            return outputs(model, loss=loss)

        compare_paths(run, dtype)
