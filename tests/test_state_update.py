"""TAPE's two state updates of a layer as Triton kernels (tapelm.kernels.state_update.triton) compute the reference
function, forward and every gradient (the state's, the attention output's, the head mixing's and the maps'): in
float64 under Triton's CPU interpreter (a subprocess with TRITON_INTERPRET=1, which is how CI runs them), on the
strides the model hands them (the first layer's E0 expanded over heads, the attention output a view of the wider
[V | E] output, the projections' token layout), with grouped queries, without the MLP's update, and with head counts
and widths that are not powers of two; TAPE models routed through them give the reference's loss and every gradient
on plain, left-padded and packed batches. Under `pytest --device cuda` the kernels run compiled, in float32 and
bf16."""

import pytest
import torch

from accuracy import compare_models_through_path
from conftest import check_triton_kernels

pytestmark = [pytest.mark.device, pytest.mark.own_process]

BATCH, KV_HEADS, HEADS, LENGTH, WIDTH = 2, 3, 6, 5, 6  # not powers of two: the kernels mask their tiles
LAYOUTS = {
    "contiguous": {},
    "E0 expanded over heads": {"expanded": True},
    "token-major state": {"token_major": True},
    "attention output of a wider stream": {"stream": True},
    "transposed maps": {"transposed": True},
    "no MLP update": {"no_mix": True},
}


def inputs(layout: str, device, dtype):
    """The leaves (state, attended, head mixing, maps) and the views the kernels get of them, drawn in float64."""
    options = LAYOUTS[layout]
    generator = torch.Generator().manual_seed(len(layout))

    def draw(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=generator, device="cpu").to(device, dtype)

    if options.get("expanded"):
        state = draw(BATCH, 1, LENGTH, WIDTH)
    elif options.get("token_major"):
        state = draw(BATCH, LENGTH, KV_HEADS, WIDTH)
    else:
        state = draw(BATCH, KV_HEADS, LENGTH, WIDTH)
    attended = draw(BATCH, HEADS, LENGTH, WIDTH + 4 if options.get("stream") else WIDTH)
    leaves = [
        state,
        attended,
        draw(KV_HEADS, HEADS),
        None if options.get("no_mix") else draw(BATCH, LENGTH, KV_HEADS, KV_HEADS),
    ]
    leaves = [None if leaf is None else leaf.requires_grad_() for leaf in leaves]

    def views(state, attended, attn_mix, mix):
        if options.get("expanded"):
            state = state.expand(-1, KV_HEADS, -1, -1)
        elif options.get("token_major"):
            state = state.transpose(1, 2)
        if options.get("stream"):
            attended = attended[..., 4:]
        if options.get("transposed"):
            mix = mix.transpose(-1, -2)
        return state, attended, attn_mix, mix

    return leaves, views


def check_kernels(device, dtype, tolerance: float) -> None:
    """The fused update against the reference (computed in float64) for every layout: output and gradients."""
    from tapelm.kernels.state_update import update_state_reference
    from tapelm.kernels.state_update.triton import update_state_triton

    for layout in LAYOUTS:
        leaves, views = inputs(layout, device, dtype)
        out = update_state_triton(*views(*leaves))
        assert out.dtype == dtype and out.shape == (BATCH, KV_HEADS, LENGTH, WIDTH), layout
        grad = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(device)
        given = [leaf for leaf in leaves if leaf is not None]
        fused = (out, *torch.autograd.grad(out, given, grad.to(dtype)))
        wide = [None if leaf is None else leaf.detach().double().requires_grad_() for leaf in leaves]
        reference_out = update_state_reference(*views(*wide))
        reference = (
            reference_out,
            *torch.autograd.grad(reference_out, [leaf for leaf in wide if leaf is not None], grad),
        )
        names = ("output", "state gradient", "attention output gradient", "head mixing gradient", "maps gradient")
        for name, actual, expected in zip(names, fused, reference):
            assert actual.dtype == dtype, f"{layout}: {name}"
            torch.testing.assert_close(
                actual.double(), expected, atol=tolerance, rtol=tolerance, msg=f"{layout}: {name}"
            )


def check_models(device, dtype) -> None:
    """Tiny TAPE models (grouped queries; both updates, and the attention update alone) through the kernels."""
    compare_models_through_path("state-update-triton", ("tape",), device, dtype)
    compare_models_through_path("state-update-triton", ("tape",), device, dtype, tape_update="attention")


def test_the_kernels_compute_the_reference_function():
    check_triton_kernels("test_state_update")


def test_a_decoding_step_stays_on_the_reference(monkeypatch):
    """Where the kernels could run (here Triton's interpreter), a one-token step takes the reference's few calls."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install tapelm[gpu])")
    from tapelm import fast_paths
    from tapelm.kernels.state_update import update_state, update_state_reference

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    generator = torch.Generator().manual_seed(0)
    state, attended, attn_mix, mix = (
        torch.randn(*shape, dtype=torch.float64, generator=generator, device="cpu")
        for shape in ((2, 3, 1, 6), (2, 6, 1, 6), (3, 6), (2, 1, 3, 3))
    )
    with fast_paths.recording() as ran:
        out = update_state(state, attended, attn_mix, mix, frozenset({"state-update-triton"}))
    assert ran == set()
    torch.testing.assert_close(out, update_state_reference(state, attended, attn_mix, mix), atol=0, rtol=0)
