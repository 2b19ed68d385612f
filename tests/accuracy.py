"""How a fast path is held to its reference path (test_fast_paths, test_fla, test_state_mixing, test_rotation_kernels).

In float64 (on the CPU, and on a device too) the two paths agree to `exact` of each tensor's largest entry. On a
device, where the kernels take half precision, the fast path's error from the reference path in float64 may be at
most `FACTOR` times the reference path's own error in that precision, plus one rounding step, both errors and the
step measured over the whole tensor (its Euclidean norm): a kernel is held to the precision a user would get without
it, not to a fixed tolerance that a few layers of bf16 rounding already exceed. The norm, not the largest entry:
two ways of rounding
differ entry by entry, and their largest errors by more than 2x on a GPU (docs/gpu/h100-2026-11-27/), while a wrong
result moves the whole tensor.

The rounding step is taken of the tensor's size, unless a second computation shows the tensor to be cancellation:
where it disagrees with the float64 reference by more than `CANCELLATION` of its norm (by more than half of its
digits; a gradient that is zero by law, as FIRE's last bias under softmax's shift invariance, whose float64 value is
3e-15: docs/gpu/h200-2026-11-27/), the reference's value is rounding left over from terms that cancel, and the step is
taken of those terms' size. Each computation's result over its dtype's unit roundoff gives that size (rounding one
term at a time leaves about the unit roundoff times the terms' size), the larger of them taken. Two second
computations are asked, the larger size kept: the fast path in float64, and the reference in float32 (which shows
what float64 cannot where the fast path in float64 is the same computation as the reference: a kernel that takes no
float64, or SDPA's math kernel standing in for CUDA's memory-efficient one, agree with it bit for bit). The float32
run can only raise the step, so it is made only for a tensor that fails without it. There two dtype results are
noise of the terms' size, and one may be more than FACTOR times the other.

A path that adds a tensor up from `accumulated` partial results in the dtype (a parameter's gradient summed over
blocks of queries, the parameters in bf16: autograd adds each block's part in the parameter's dtype) rounds once more
per part past the first, each at about the tensor's size (parts of one sign, as a gradient's blocks mostly are):
`accumulated` rounding steps in all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FACTOR = 2.0
ROUNDING = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
"""Half the spacing of each dtype's numbers near 1, relative."""
CANCELLATION = {torch.float64: 2.0**-26, torch.float32: 2.0**-12}
"""Two computations that agree to fewer than half of the second one's digits show a tensor made by cancellation."""

Outputs = dict[str, "torch.Tensor | None"]


def outputs(model: torch.nn.Module, **named: torch.Tensor | None) -> Outputs:
    """The named tensors of one pass (detached) and every parameter's gradient."""
    return {
        **{name: None if value is None else value.detach() for name, value in named.items()},
        **{f"grad {name}": param.grad for name, param in model.named_parameters()},
    }


def compare_paths(
    run: Callable[[str, torch.dtype], Outputs], dtype: torch.dtype, exact: float = 1e-12, accumulated: int = 1
) -> None:
    """`run(setting, dtype)` gives the named tensors of one pass with `fast_paths=setting` in `dtype`: those of "on"
    in float64 against "off" in float64, each to `exact` of its largest entry, and in another `dtype` by the rule
    above (the fast path adding each tensor up from `accumulated` parts in `dtype`)."""
    truth = run("off", torch.float64)
    truth_on = run("on", torch.float64)
    actual = None if dtype == torch.float64 else run("on", dtype)
    baseline = None if dtype == torch.float64 else run("off", dtype)
    in_float32 = []  # the reference in float32, run once where a tensor's verdict needs it
    assert truth_on.keys() == truth.keys()
    for name, expected in truth.items():
        assert (truth_on[name] is None) == (expected is None), name
        if expected is None:
            continue
        expected, other_order = expected.double(), truth_on[name].double()
        largest = expected.abs().max().item()
        error = (other_order - expected).abs().max().item()
        assert error <= exact * max(largest, 1.0), (
            f"{name}: largest error {error:.3g} from the float64 reference in "
            f"float64, allowed {exact * max(largest, 1.0):.3g} (largest entry "
            f"{largest:.3g})"
        )
        if actual is None:
            continue
        error = (actual[name].double() - expected).norm().item()
        own_error = (baseline[name].double() - expected).norm().item()
        scale = rounding_scale(expected, other_order)
        allowed = FACTOR * own_error + accumulated * ROUNDING[dtype] * scale
        if error > allowed and dtype != torch.float32:  # the float32 probe can only raise the scale: run it to decide
            in_float32 = in_float32 or [run("off", torch.float32)]
            scale = max(scale, rounding_scale(expected, in_float32[0][name].double(), torch.float32))
            allowed = FACTOR * own_error + accumulated * ROUNDING[dtype] * scale
        assert error <= allowed, (
            f"{name}: error (norm) {error:.3g} from the float64 reference, allowed "
            f"{allowed:.3g} (rounding scale {scale:.3g}, norm {expected.norm().item():.3g})"
        )


def rounding_scale(expected: torch.Tensor, other: torch.Tensor, other_dtype: torch.dtype = torch.float64) -> float:
    """The size rounding acts on: the tensor's norm, or where another computation (`other`, computed in
    `other_dtype`) shows it to be cancellation, the size of the terms that cancel: the float64 reference's result,
    the other's and their disagreement are then all rounding of that size, the largest of them over its computation's
    unit roundoff."""
    norm = expected.norm().item()
    disagreement = (other - expected).norm().item()
    if disagreement <= CANCELLATION[other_dtype] * norm:
        return norm
    return max(norm / ROUNDING[torch.float64], max(other.norm().item(), disagreement) / ROUNDING[other_dtype])


BATCHES = ("plain", "padded", "packed")
"""The batches a model is held to its reference on: no mask; the second row left-padded by 3 tokens; two packed
documents a row (positions restarting after 4 tokens)."""


def batch_inputs(kind: str, ids: torch.Tensor) -> dict:
    if kind == "padded":
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        return {"attention_mask": mask}
    if kind == "packed":
        return {
            "position_ids": torch.cat(
                [torch.arange(4, device=ids.device), torch.arange(ids.shape[1] - 4, device=ids.device)]
            )[None]
        }
    return {}


def compare_models_through_path(path: str, encodings: tuple[str, ...], device, dtype: torch.dtype, **overrides) -> None:
    """Tiny models of `encodings` (with config `overrides`) with fast path `path` alone (`fast_paths=[path]`)
    against the reference paths, on each of `BATCHES`: the loss and every parameter's gradient (`compare_paths`); the
    path must have run. On the CPU tapelm's Triton kernels run under Triton's interpreter (`TRITON_INTERPRET=1`)."""
    from conftest import tiny_model, tokens
    from tapelm import fast_paths

    ids = tokens(2, 9).to(device)
    for encoding in encodings:
        for batch in BATCHES:

            def run(setting, setting_dtype, encoding=encoding, batch=batch):
                model = tiny_model(
                    encoding, dtype=setting_dtype, fast_paths=[path] if setting == "on" else [], **overrides
                ).to(device)
                with fast_paths.recording() as ran:
                    loss = model.train()(ids, labels=ids, **batch_inputs(batch, ids)).loss
                    loss.backward()
                assert ran == ({path} if setting == "on" else set()), (encoding, batch, setting, ran)
                return outputs(model, loss=loss)

            compare_paths(run, dtype)
