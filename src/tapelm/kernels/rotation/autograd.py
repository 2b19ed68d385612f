"""`rotate_halves` as an autograd function with a hand-written backward (fast path "rotation-autograd"): the forward
writes both halves straight into the output, each product rounded as the reference rounds it, and the backward computes
the gradient of x and of (a, b) in a few passes, summing over the dimensions (a, b) were broadcast along once, where
autograd through the reference makes a temporary per product and a reduction per broadcast operand."""

from __future__ import annotations

import torch

from .naive import output_like


class HalvesRotation(torch.autograd.Function):
    """`rotate_halves` with a hand-written backward: dx = dy (a - i b), d(a + i b) = dy conj(x) summed over the
    broadcast dimensions. Differentiable once."""

    @staticmethod
    def forward(ctx, x, a, b):
        y = output_like(x, a, b)
        _turn(y, x, a, b, conjugate=False)
        angles_need_grad = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        ctx.save_for_backward(x if angles_need_grad else None, a, b)  # x only for the angles' gradient
        ctx.x_dtype = x.dtype
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, a, b = ctx.saved_tensors
        half = dy.shape[-1] // 2
        grad_x = grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.empty_like(dy)
            _turn(grad_x, dy, a, b, conjugate=True)
            grad_x = grad_x.to(ctx.x_dtype)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            dy1, dy2, x1, x2 = dy[..., :half], dy[..., half:], x[..., :half], x[..., half:]
            grad_a = torch.mul(dy1, x1).addcmul_(dy2, x2).sum_to_size(a.shape).to(a.dtype)
            grad_b = torch.mul(dy2, x1).addcmul_(dy1, x2, value=-1).sum_to_size(b.shape).to(b.dtype)
        return grad_x, grad_a, grad_b


def _turn(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conjugate: bool) -> None:
    """out = x (a + i b), or x (a - i b) with `conjugate`, written half by half, each product rounded before the
    sum as in the reference (so the forward pass gives the reference's very bits)."""
    half = x.shape[-1] // 2
    x1, x2, out1, out2 = x[..., :half], x[..., half:], out[..., :half], out[..., half:]
    first, second = (torch.Tensor.add_, torch.Tensor.sub_) if conjugate else (torch.Tensor.sub_, torch.Tensor.add_)
    first(torch.mul(x1, a, out=out1), x2 * b)
    second(torch.mul(x2, a, out=out2), x1 * b)


__all__ = ["HalvesRotation"]
