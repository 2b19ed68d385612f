"""TAPE's state-mixing kernels (tapelm.kernels.state_mixing) compute the reference function, forward and both
gradients: in float64 under Triton's CPU interpreter (a subprocess with TRITON_INTERPRET=1, which is how CI runs
them), on any strides the state arrives with (expanded over heads as the first layer's E0, the projections' token
layout), with head counts and widths that are not powers of two; and a TAPE model routed through them gives the
reference's loss and every gradient on plain, left-padded and packed batches. Under `pytest --device cuda` the
kernels run compiled, in float32 and bf16. The
reference's one-token branches (an eager or a compiled decoding step) compute what it computes for a sequence."""

import pytest
import torch

from accuracy import compare_models_through_path
from conftest import DEVICE, check_triton_kernels

pytestmark = [pytest.mark.device, pytest.mark.own_process]

BATCH, HEADS, LENGTH, WIDTH = 2, 3, 5, 6  # not powers of two: the kernels mask their tiles
VIEWS = {
    "contiguous": ((BATCH, HEADS, LENGTH, WIDTH), lambda state, mix: (state, mix)),
    "expanded over heads": ((BATCH, 1, LENGTH, WIDTH), lambda state, mix: (state.expand(-1, HEADS, -1, -1), mix)),
    "token-major": ((BATCH, LENGTH, HEADS, WIDTH), lambda state, mix: (state.transpose(1, 2), mix)),
    "transposed map": ((BATCH, HEADS, LENGTH, WIDTH), lambda state, mix: (state, mix.transpose(-1, -2))),
}
"""Per layout: the shape of the state's leaf, and how the state (B, Hkv, N, W) and the per-token maps
(B, N, Hkv, Hkv) are viewed from the two leaves (the first layer's E0 is expanded over heads; the projections
give a token-major layout)."""


def leaves(layout: str, device, dtype):
    """The two leaf tensors of `layout`, drawn in float64 on the CPU."""
    generator = torch.Generator().manual_seed(len(layout))
    return tuple(
        torch.randn(*shape, dtype=torch.float64, generator=generator, device="cpu").to(device, dtype).requires_grad_()
        for shape in (VIEWS[layout][0], (BATCH, LENGTH, HEADS, HEADS))
    )


def check_kernels(device, dtype, tolerance: float) -> None:
    """The fused update against the reference (computed in float64) for every layout: output and gradients."""
    from tapelm.kernels.state_mixing import mix_state_reference
    from tapelm.kernels.state_mixing.triton import mix_state_triton

    for layout, (_, view) in VIEWS.items():
        tensors = leaves(layout, device, dtype)
        out = mix_state_triton(*view(*tensors))
        assert out.dtype == dtype and out.shape == (BATCH, HEADS, LENGTH, WIDTH), layout
        grad = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(device)
        fused = (out, *torch.autograd.grad(out, tensors, grad.to(dtype)))
        wide = [tensor.detach().double().requires_grad_() for tensor in tensors]
        reference_out = mix_state_reference(*view(*wide))
        reference = (reference_out, *torch.autograd.grad(reference_out, wide, grad))
        for name, actual, expected in zip(("output", "state gradient", "map gradient"), fused, reference):
            torch.testing.assert_close(
                actual.double(), expected, atol=tolerance, rtol=tolerance, msg=f"{layout}: {name}"
            )


def check_models(device, dtype) -> None:
    """A tiny TAPE model with the kernels on against the reference paths."""
    compare_models_through_path("state-mixing-triton", ("tape",), device, dtype)


def test_the_kernels_compute_the_reference_function():
    check_triton_kernels("test_state_mixing")


def check_one_token_at_a_time(sequence, step, layout: str) -> None:
    """`step` applied to one token at a time equals `sequence` over all of them, output and gradients, in float64."""
    tensors = leaves(layout, DEVICE, torch.float64)
    state, mix = VIEWS[layout][1](*tensors)
    whole = sequence(state, mix)
    grads = torch.autograd.grad(whole.sum(), tensors)
    singles = torch.cat([step(state[:, :, n : n + 1], mix[:, n : n + 1]) for n in range(LENGTH)], dim=2)
    torch.testing.assert_close(singles, whole, atol=1e-12, rtol=0)
    for actual, expected in zip(torch.autograd.grad(singles.sum(), tensors), grads):
        torch.testing.assert_close(actual, expected, atol=1e-12, rtol=0)


@pytest.mark.compiles
@pytest.mark.parametrize("layout", list(VIEWS))
def test_a_compiled_decoding_step_mixes_as_a_sequence_does(layout):
    """One token compiled (the broadcast product) equals the per-token batched product over a sequence."""
    from tapelm.kernels.state_mixing import state_delta

    check_one_token_at_a_time(
        state_delta, torch.compile(state_delta, backend="eager", fullgraph=True, dynamic=False), layout
    )


@pytest.mark.parametrize("layout", list(VIEWS))
def test_an_eager_decoding_step_mixes_as_a_sequence_does(layout):
    """One token at a time through the reference's one-token branch equals its per-token product over a sequence."""
    from tapelm.kernels.state_mixing import mix_state_reference

    check_one_token_at_a_time(mix_state_reference, mix_state_reference, layout)


def test_a_decoding_step_stays_on_the_reference(monkeypatch):
    """One token's update is one call on the reference path, fewer launches than the kernel's: where the kernels
    could run (here Triton's interpreter), a one-token step does not take them."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install tapelm[gpu])")
    from tapelm import fast_paths
    from tapelm.kernels.state_mixing import mix_state, mix_state_reference

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    state, mix = (torch.randn(*shape, dtype=torch.float64, device="cpu") for shape in ((2, 3, 1, 6), (2, 1, 3, 3)))
    with fast_paths.recording() as ran:
        out = mix_state(state, mix, frozenset({"state-mixing-triton"}))
    assert ran == set()
    torch.testing.assert_close(out, mix_state_reference(state, mix), atol=0, rtol=0)
