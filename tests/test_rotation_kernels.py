"""The rotation kernels (tapelm.kernels.rotation.triton) compute the reference function `rotate_halves`, forward and
every gradient: in float64 under Triton's CPU interpreter (a subprocess with TRITON_INTERPRET=1, which is how CI runs
them), for TAPE's grouped queries and keys and RoPE's tables over heads, on the strides the projections give, with
token counts and widths that are not powers of two; training under bf16 autocast they write bf16, the reference's
result rounded once; and TAPE and RoPE models routed through them give the reference's loss and every gradient. Under `pytest --device cuda` the kernels run compiled, in float32 and bf16."""

import pytest
import torch

from accuracy import compare_models_through_path
from conftest import DEVICE, run_under_triton_interpreter

pytestmark = [pytest.mark.device, pytest.mark.own_process]

LAYOUTS = {  # x's shape and (a, b)'s, as the encodings call the rotation
    "TAPE's grouped queries": ((2, 3, 2, 19, 10), (2, 3, 1, 19, 5)),
    "TAPE's keys": ((2, 3, 19, 10), (2, 3, 19, 5)),
    "RoPE's tables over heads": ((2, 4, 19, 8), (2, 1, 19, 4)),
    "one table for the batch": ((2, 4, 19, 8), (1, 1, 19, 4)),
}


def check_kernels(device, dtype, tolerance: float) -> None:
    """The kernels against the reference (computed in float64) for every layout, with and without the angles'
    gradient: output (its dtype and memory layout too) and every gradient."""
    from tapelm.kernels.rotation import rotate_halves
    from tapelm.kernels.rotation.triton import rotate_halves_triton, takes

    generator = torch.Generator().manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=generator, device="cpu").to(device)

    for layout, (x_shape, angle_shape) in LAYOUTS.items():
        for angles_need_grad in (True, False):
            # x a view of a token-major tensor (B, N, heads, d), as the projections give q and k
            x = draw(*x_shape[:-3], x_shape[-2], x_shape[-3], x_shape[-1]).transpose(-2, -3)
            a, b, weights = draw(*angle_shape), draw(*angle_shape), draw(*x_shape)
            assert takes(x, a, b), layout
            inputs = [x.to(dtype).requires_grad_(), *(t.to(dtype).requires_grad_(angles_need_grad) for t in (a, b))]
            out = rotate_halves_triton(*inputs)
            assert out.dtype == dtype and out.stride() == inputs[0].stride(), layout
            fused = (out, *torch.autograd.grad(out, [t for t in inputs if t.requires_grad], weights.to(dtype)))
            wide = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
            reference_out = rotate_halves(*wide)
            reference = (reference_out, *torch.autograd.grad(reference_out, [t for t in wide if t.requires_grad],
                                                             weights))
            for name, actual, expected in zip(("output", "x", "a", "b"), fused, reference):
                assert actual.dtype == dtype, f"{layout}: {name}"
                torch.testing.assert_close(actual.double(), expected, atol=tolerance, rtol=tolerance,
                                           msg=f"{layout}, angles_need_grad={angles_need_grad}: {name}")


def check_autocast(device) -> None:
    """Training under bf16 autocast, `rotate_pairs` through the kernels writes q in bf16 (what attention computes
    in): the reference's float32 rotation rounded to bf16 (within one rounding), and every gradient within bf16's."""
    from tapelm.kernels.rotation import rotate_pairs

    generator = torch.Generator().manual_seed(0)
    x, a, b, weights = (torch.randn(*shape, generator=generator, device="cpu").to(device)
                        for shape in ((2, 3, 2, 19, 10), (2, 3, 1, 19, 5), (2, 3, 1, 19, 5), (2, 3, 2, 19, 10)))
    results = []
    for paths in ({"rotation-triton"}, set()):
        inputs = [t.clone().requires_grad_() for t in (x, a, b)]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = rotate_pairs(*inputs, frozenset(paths))
        assert out.dtype == (torch.bfloat16 if paths else torch.float32)
        (out.float() * weights).sum().backward()
        results.append((out.float(), [t.grad for t in inputs]))
    (kernel, kernel_grads), (reference, reference_grads) = results
    torch.testing.assert_close(kernel, reference.bfloat16().float(), rtol=0, atol=2 * 2**-8 * reference.abs().max().item())
    for name, actual, expected in zip("xab", kernel_grads, reference_grads):
        torch.testing.assert_close(actual, expected, rtol=2**-7, atol=2**-7 * expected.abs().max().item(), msg=name)


def check_models(device, dtype) -> None:
    """Tiny TAPE (grouped queries) and RoPE models with the kernels on against the reference paths."""
    compare_models_through_path("rotation-triton", ("tape", "rope"), device, dtype)


def test_the_kernels_compute_the_reference_function():
    pytest.importorskip("triton", reason="Triton is not installed (pip install tapelm[gpu])")
    if DEVICE.type == "cuda":
        check_kernels(DEVICE, torch.float32, 1e-5)
        check_kernels(DEVICE, torch.bfloat16, 3e-2)
        check_autocast(DEVICE)
        check_models(DEVICE, torch.bfloat16)
        return
    script = ("import sys, torch; sys.path.insert(0, 'tests'); import test_rotation_kernels as t; "
              "cpu = torch.device('cpu'); t.check_kernels(cpu, torch.float64, 1e-12); t.check_autocast(cpu); "
              "t.check_models(cpu, torch.float64)")
    run_under_triton_interpreter(script)


def test_the_kernels_take_only_what_they_compute():
    pytest.importorskip("triton", reason="Triton is not installed (pip install tapelm[gpu])")
    from tapelm.kernels.rotation.triton import takes

    x = torch.zeros(2, 4, 5, 8)
    assert takes(x, torch.zeros(2, 1, 5, 4), torch.zeros(2, 1, 5, 4))
    assert not takes(x, torch.zeros(2, 1, 5, 8), torch.zeros(2, 1, 5, 8))  # angles as wide as x
    assert not takes(x[..., :7], torch.zeros(2, 1, 5, 3), torch.zeros(2, 1, 5, 3))  # an odd width
    assert not takes(x.unsqueeze(2), torch.zeros(2, 4, 3, 5, 4), torch.zeros(2, 4, 3, 5, 4))  # angles per group head
    assert not takes(x, torch.zeros(5, 4), torch.zeros(5, 4))  # angles of another rank
