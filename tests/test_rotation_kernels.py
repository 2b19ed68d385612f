"""The rotation kernels (tapelm.kernels.rotation.triton) compute the reference function `rotate_reference`, queries
and keys in one call, forward and every gradient: in float64 under Triton's CPU interpreter (a subprocess with
TRITON_INTERPRET=1, which is how CI runs them), for TAPE's state with grouped queries, RoPE's tables over heads and
xPos's separate key tables, on the strides the projections give, with token counts and widths that are not powers of
two; training under bf16 autocast they write bf16, the reference's result rounded once; and TAPE, RoPE and xPos
models routed through them give the reference's loss and every gradient on plain, left-padded and packed batches.
Under `pytest --device cuda` the kernels run compiled, in float32 and bf16."""

import pytest
import torch

from accuracy import compare_models_through_path
from conftest import check_triton_kernels

pytestmark = [pytest.mark.device, pytest.mark.own_process]

LAYOUTS = {  # (q's heads, k's heads, the angles' shape) as the encodings call the rotation: TAPE's state per KV
    # head (with grouped queries), RoPE's table per sequence, and one table for the batch
    "TAPE's state, grouped queries": (6, 3, (2, 3, 19, 10)),
    "TAPE's state, one query a KV head": (3, 3, (2, 3, 19, 10)),
    "RoPE's tables over heads": (4, 2, (2, 1, 19, 10)),
    "one table for the batch": (4, 4, (1, 1, 19, 10)),
}


def check_kernels(device, dtype, tolerance: float) -> None:
    """The kernels against the reference (computed in float64) for every layout, with and without the angles'
    gradient, with the keys' own angles (xPos) where there is none: both outputs (their dtype and memory layout too)
    and every gradient."""
    from tapelm.kernels.rotation import rotate_reference
    from tapelm.kernels.rotation.triton import rotate_triton, takes

    generator = torch.Generator().manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=generator, device="cpu").to(device)

    for layout, (heads, kv_heads, angle_shape) in LAYOUTS.items():
        for angles_need_grad, own_key_angles in ((True, False), (False, False), (False, True)):
            # q and k views of token-major tensors (B, N, heads, d), as the projections give them
            q, k = (draw(2, 19, count, 10).transpose(1, 2) for count in (heads, kv_heads))
            angles, key_angles = draw(*angle_shape), draw(*angle_shape)
            weights = draw(2, heads, 19, 10), draw(2, kv_heads, 19, 10)
            leaves = [
                q.to(dtype).requires_grad_(),
                k.to(dtype).requires_grad_(),
                angles.to(dtype).requires_grad_(angles_need_grad),
            ]
            keys_own = key_angles.to(dtype) if own_key_angles else leaves[2]
            assert takes(*leaves, keys_own), layout
            outs = rotate_triton(*leaves, keys_own)
            assert [out.dtype for out in outs] == [dtype, dtype], layout
            assert [out.stride() for out in outs] == [leaf.stride() for leaf in leaves[:2]], layout
            given = [leaf for leaf in leaves if leaf.requires_grad]
            fused = (*outs, *torch.autograd.grad(outs, given, [w.to(dtype) for w in weights]))
            wide = [leaf.detach().double().requires_grad_(leaf.requires_grad) for leaf in leaves]
            reference_outs = rotate_reference(*wide, key_angles.double() if own_key_angles else None)
            reference = (
                *reference_outs,
                *torch.autograd.grad(reference_outs, [t for t in wide if t.requires_grad], weights),
            )
            for name, actual, expected in zip(("q", "k", "grad q", "grad k", "grad angles"), fused, reference):
                assert actual.dtype == dtype, f"{layout}: {name}"
                torch.testing.assert_close(
                    actual.double(),
                    expected,
                    atol=tolerance,
                    rtol=tolerance,
                    msg=f"{layout}, angles_need_grad={angles_need_grad}: {name}",
                )


def check_autocast(device) -> None:
    """Training under bf16 autocast, the rotation through the kernels writes q and k in bf16 (what attention
    computes in): the reference's float32 rotation rounded to bf16 (within one rounding), and every gradient within
    bf16's."""
    from tapelm.kernels.rotation import rotate_queries_and_keys

    generator = torch.Generator().manual_seed(0)
    q, k, angles, q_weights, k_weights = (
        torch.randn(*shape, generator=generator, device="cpu").to(device)
        for shape in ((2, 6, 19, 10), (2, 3, 19, 10), (2, 3, 19, 10), (2, 6, 19, 10), (2, 3, 19, 10))
    )
    results = []
    for paths in ({"rotation-triton"}, set()):
        inputs = [t.clone().requires_grad_() for t in (q, k, angles)]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            outs = rotate_queries_and_keys(*inputs, frozenset(paths))
        assert [out.dtype for out in outs] == [torch.bfloat16 if paths else torch.float32] * 2
        ((outs[0].float() * q_weights).sum() + (outs[1].float() * k_weights).sum()).backward()
        results.append(([out.float() for out in outs], [t.grad for t in inputs]))
    (kernel, kernel_grads), (reference, reference_grads) = results
    for actual, expected in zip(kernel, reference):
        torch.testing.assert_close(
            actual, expected.bfloat16().float(), rtol=0, atol=2 * 2**-8 * expected.abs().max().item()
        )
    for name, actual, expected in zip(("q", "k", "angles"), kernel_grads, reference_grads):
        torch.testing.assert_close(actual, expected, rtol=2**-7, atol=2**-7 * expected.abs().max().item(), msg=name)


def check_models(device, dtype) -> None:
    """Tiny TAPE (grouped queries), RoPE, xPos and GRAPE-M models with the kernels on against the reference paths
    (GRAPE-M's tables need a gradient, as TAPE's state does)."""
    compare_models_through_path("rotation-triton", ("tape", "rope", "xpos", "grape-m-fixed", "grape-m"), device, dtype)


def test_the_kernels_compute_the_reference_function():
    check_triton_kernels("test_rotation_kernels", "check_autocast")


def test_the_kernels_take_only_what_they_compute():
    pytest.importorskip("triton", reason="Triton is not installed (pip install tapelm[gpu])")
    from tapelm.kernels.rotation.triton import takes

    q, k, angles = torch.zeros(2, 4, 5, 8), torch.zeros(2, 2, 5, 8), torch.zeros(2, 1, 5, 8)
    assert takes(q, k, angles, angles)
    assert not takes(q, k, torch.zeros(2, 1, 5, 16), torch.zeros(2, 1, 5, 16))  # angles wider than the pairs
    assert not takes(q[..., :7], k[..., :7], angles[..., :7], angles[..., :7])  # an odd width
    assert not takes(q[:, :3], k, angles, angles)  # query heads that do not group by KV head
    assert not takes(q, k, torch.zeros(5, 8), torch.zeros(5, 8))  # angles of another rank
    state = torch.zeros(2, 2, 5, 8, requires_grad=True)
    assert not takes(q, k, state, torch.zeros(2, 2, 5, 8))  # keys' own angles beside angles that need a gradient
