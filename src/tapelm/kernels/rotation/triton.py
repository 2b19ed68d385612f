"""`rotate_halves` as Triton kernels (fast path "rotation-triton"): one program per (batch, KV head) and block of
tokens reads the block's angles (a, b) once and rotates every query head of the KV head's group, or its key head,
writing each output once; the backward pass writes the gradient of x and, where the angles need one (TAPE's state),
their gradient summed over the group in the same pass. The reference makes a temporary per product and per sum (about
a dozen passes over q and k in float32, forward and backward). Computes in float32 (float64 for float64 inputs).
Runs on CUDA, and on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`), which is how CI tests it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_TOKENS = 16


@triton.jit
def _tile(length, half, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's batch row, KV head, token and pair indices, and the tile's mask. The blocks of tokens run
    along the grid's first axis, the only one that takes more than 65,535 programs."""
    kv_heads = tl.num_programs(1)
    row, head = tl.program_id(2).to(tl.int64), tl.program_id(1).to(tl.int64)
    tokens = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    pairs = tl.arange(0, BLOCK_D)
    return row, head, tokens, pairs, (tokens[:, None] < length) & (pairs[None, :] < half), kv_heads


@triton.jit
def _load(pointer, mask, WIDE: tl.constexpr):
    return tl.load(pointer, mask=mask, other=0.0).to(tl.float64 if WIDE else tl.float32)


@triton.jit
def _rotate_forward(x, a, b, y, length, half, groups,
                    x_b, x_h, x_g, x_n, x_d, a_b, a_h, a_n, a_d, b_b, b_h, b_n, b_d, y_b, y_h, y_g, y_n, y_d,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WIDE: tl.constexpr):
    row, head, tokens, pairs, tile, _ = _tile(length, half, BLOCK_N, BLOCK_D)
    cos = _load(a + row * a_b + head * a_h + tokens[:, None] * a_n + pairs[None, :] * a_d, tile, WIDE)
    sin = _load(b + row * b_b + head * b_h + tokens[:, None] * b_n + pairs[None, :] * b_d, tile, WIDE)
    for g in range(groups):
        source = x + row * x_b + head * x_h + g * x_g + tokens[:, None] * x_n + pairs[None, :] * x_d
        target = y + row * y_b + head * y_h + g * y_g + tokens[:, None] * y_n + pairs[None, :] * y_d
        first, second = _load(source, tile, WIDE), _load(source + half * x_d, tile, WIDE)
        tl.store(target, (first * cos - second * sin).to(y.dtype.element_ty), mask=tile)
        tl.store(target + half * y_d, (second * cos + first * sin).to(y.dtype.element_ty), mask=tile)


@triton.jit
def _rotate_backward(dy, x, a, b, dx, da, db, length, half, groups,
                     dy_b, dy_h, dy_g, dy_n, dy_d, x_b, x_h, x_g, x_n, x_d, a_b, a_h, a_n, a_d, b_b, b_h, b_n, b_d,
                     dx_b, dx_h, dx_g, dx_n, dx_d, ANGLES: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WIDE: tl.constexpr):
    row, head, tokens, pairs, tile, kv_heads = _tile(length, half, BLOCK_N, BLOCK_D)
    cos = _load(a + row * a_b + head * a_h + tokens[:, None] * a_n + pairs[None, :] * a_d, tile, WIDE)
    sin = _load(b + row * b_b + head * b_h + tokens[:, None] * b_n + pairs[None, :] * b_d, tile, WIDE)
    grad_cos = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float64 if WIDE else tl.float32)
    grad_sin = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float64 if WIDE else tl.float32)
    for g in range(groups):
        incoming = dy + row * dy_b + head * dy_h + g * dy_g + tokens[:, None] * dy_n + pairs[None, :] * dy_d
        target = dx + row * dx_b + head * dx_h + g * dx_g + tokens[:, None] * dx_n + pairs[None, :] * dx_d
        first, second = _load(incoming, tile, WIDE), _load(incoming + half * dy_d, tile, WIDE)
        tl.store(target, (first * cos + second * sin).to(dx.dtype.element_ty), mask=tile)  # dy (a - i b)
        tl.store(target + half * dx_d, (second * cos - first * sin).to(dx.dtype.element_ty), mask=tile)
        if ANGLES:  # d(a + i b) = dy conj(x), summed over the group
            source = x + row * x_b + head * x_h + g * x_g + tokens[:, None] * x_n + pairs[None, :] * x_d
            x_first, x_second = _load(source, tile, WIDE), _load(source + half * x_d, tile, WIDE)
            grad_cos += first * x_first + second * x_second
            grad_sin += second * x_first - first * x_second
    if ANGLES:
        angles = ((row * kv_heads + head) * length + tokens[:, None]) * half + pairs[None, :]
        tl.store(da + angles, grad_cos, mask=tile)
        tl.store(db + angles, grad_sin, mask=tile)


def _grouped(x: torch.Tensor) -> torch.Tensor:
    """x as (B, Hkv, G, N, d): a 4-D x is its own group of one."""
    return x if x.dim() == 5 else x.unsqueeze(2)


def _angles(angle: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """An angle table broadcast to (B, Hkv, N, d/2) for x (B, Hkv, G, N, d) (stride 0 where it broadcasts)."""
    batch, kv_heads, _, length, width = x.shape
    full = angle if angle.dim() == 4 else angle.squeeze(2)
    return full.expand(batch, kv_heads, length, width // 2)


def takes(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the kernels take this call: x (B, H, N, d) or grouped (B, Hkv, G, N, d), even d, and angles of x's
    rank that broadcast into its halves, with no group dimension of their own."""
    if x.dim() not in (4, 5) or x.shape[-1] % 2 or a.dim() != x.dim() or b.shape != a.shape:
        return False
    if x.dim() == 5 and a.shape[2] != 1:
        return False
    halves = (*x.shape[:-1], x.shape[-1] // 2)
    return all(size in (1, full) for size, full in zip(a.shape, halves))


def _launch(kernel, x: torch.Tensor, wide: bool, *args, **constants) -> None:
    """`kernel` over x (B, Hkv, G, N, d): a program per block of tokens, KV head and batch row."""
    batch, kv_heads, _, length, width = x.shape
    grid = (triton.cdiv(length, BLOCK_TOKENS), kv_heads, batch)
    kernel[grid](*args, BLOCK_N=BLOCK_TOKENS, BLOCK_D=triton.next_power_of_2(width // 2), WIDE=wide, **constants)


class KernelRotation(torch.autograd.Function):
    """`rotate_halves(x, a, b)` through the kernels, for calls `takes` accepts, written in `dtype` where given (else
    the promoted dtype, as the reference). Keeps what `HalvesRotation` keeps (x only where the angles need a
    gradient). Differentiable once."""

    @staticmethod
    def forward(ctx, x, a, b, dtype=None):
        y = torch.empty_like(x, dtype=dtype or torch.promote_types(torch.promote_types(x.dtype, a.dtype), b.dtype))
        grouped, out = _grouped(x), _grouped(y)
        cos, sin = _angles(a, grouped), _angles(b, grouped)
        _, _, groups, length, width = grouped.shape
        wide = torch.float64 in (x.dtype, a.dtype, b.dtype)
        _launch(_rotate_forward, grouped, wide, grouped, cos, sin, out, length, width // 2, groups, *grouped.stride(),
                *cos.stride(), *sin.stride(), *out.stride())
        angles_need_grad = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        ctx.save_for_backward(x if angles_need_grad else None, a, b)
        ctx.x_dtype, ctx.x_shape = x.dtype, x.shape
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, a, b = ctx.saved_tensors
        angles_need_grad = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        grad_x = torch.empty(ctx.x_shape, dtype=ctx.x_dtype, device=dy.device)
        incoming, outgoing = _grouped(dy), _grouped(grad_x)
        cos, sin = _angles(a, incoming), _angles(b, incoming)
        source = _grouped(x) if angles_need_grad else incoming
        batch, kv_heads, groups, length, width = incoming.shape
        wide = torch.float64 in (dy.dtype, a.dtype, b.dtype)
        grads = [torch.empty((batch, kv_heads, length, width // 2) if angles_need_grad else (1,),
                             dtype=torch.float64 if wide else torch.float32, device=dy.device) for _ in range(2)]
        _launch(_rotate_backward, incoming, wide, incoming, source, cos, sin, outgoing, *grads, length, width // 2,
                groups, *incoming.stride(), *source.stride(), *cos.stride(), *sin.stride(), *outgoing.stride(),
                ANGLES=angles_need_grad)
        grad_a = grad_b = None
        if angles_need_grad:
            grad_a, grad_b = ((grad if angle.dim() == 4 else grad.unsqueeze(2)).sum_to_size(angle.shape)
                              .to(angle.dtype) for grad, angle in zip(grads, (a, b)))
        return grad_x if ctx.needs_input_grad[0] else None, grad_a, grad_b, None


def rotate_halves_triton(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                        dtype: torch.dtype | None = None) -> torch.Tensor:
    """`rotate_halves(x, a, b)` through `KernelRotation`, in `dtype` where given."""
    return KernelRotation.apply(x, a, b, dtype)


__all__ = ["KernelRotation", "rotate_halves_triton", "takes"]
