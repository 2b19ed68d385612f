"""The rotation of queries and keys as Triton kernels (fast path "rotation-triton"): one program per (batch, KV head)
and block of tokens reads the block's angles once and rotates every query head of the KV head's group and its key
head, writing each output once; the backward pass writes the gradients of q and k and, where the angles need one
(TAPE's state), their gradient summed over the group's queries and the key in the same pass, in the angles' own
[a | b] layout. The reference makes a temporary per product and per sum (about a dozen passes over q and k in
float32, forward and backward), and autograd a gradient of the angles per tensor, their sum and their halves' join.
Computes in float32 (float64 for float64 inputs). Runs on CUDA, and on the CPU under Triton's interpreter
(`TRITON_INTERPRET=1`), which is how CI tests it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_TOKENS = 16


@triton.jit
def _tile(length, half, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's batch row, KV head, token and pair indices, and the tile's mask. The blocks of tokens run
    along the grid's first axis, the only one that takes more than 65,535 programs."""
    row, head = tl.program_id(2).to(tl.int64), tl.program_id(1).to(tl.int64)
    tokens = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    pairs = tl.arange(0, BLOCK_D)
    return row, head, tokens, pairs, (tokens[:, None] < length) & (pairs[None, :] < half)


@triton.jit
def _load(pointer, mask, WIDE: tl.constexpr):
    return tl.load(pointer, mask=mask, other=0.0).to(tl.float64 if WIDE else tl.float32)


@triton.jit
def _halves(base, s_b, s_h, s_n, s_d, row, head, tokens, pairs, half, tile, WIDE: tl.constexpr):
    """The first and second halves of one batch row's and head's (token, pair) tile at `base`."""
    at = base + row * s_b + head * s_h + tokens[:, None] * s_n + pairs[None, :] * s_d
    return _load(at, tile, WIDE), _load(at + half * s_d, tile, WIDE)


@triton.jit
def _turn(first, second, cos, sin, target, s_d, half, tile, CONJUGATE: tl.constexpr):
    """Write (first + i second)(cos + i sin), or times its conjugate, at `target` in its dtype."""
    if CONJUGATE:
        sin = -sin
    tl.store(target, (first * cos - second * sin).to(target.dtype.element_ty), mask=tile)
    tl.store(target + half * s_d, (second * cos + first * sin).to(target.dtype.element_ty), mask=tile)


@triton.jit
def _rotate_forward(
    q,
    k,
    angles,
    key_angles,
    q_out,
    k_out,
    length,
    half,
    groups,
    q_b,
    q_h,
    q_g,
    q_n,
    q_d,
    k_b,
    k_h,
    k_n,
    k_d,
    t_b,
    t_h,
    t_n,
    t_d,
    u_b,
    u_h,
    u_n,
    u_d,
    o_b,
    o_h,
    o_g,
    o_n,
    o_d,
    p_b,
    p_h,
    p_n,
    p_d,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WIDE: tl.constexpr,
):
    row, head, tokens, pairs, tile = _tile(length, half, BLOCK_N, BLOCK_D)
    cos, sin = _halves(angles, t_b, t_h, t_n, t_d, row, head, tokens, pairs, half, tile, WIDE)
    for g in range(groups):
        first, second = _halves(q + g * q_g, q_b, q_h, q_n, q_d, row, head, tokens, pairs, half, tile, WIDE)
        target = q_out + g * o_g + row * o_b + head * o_h + tokens[:, None] * o_n + pairs[None, :] * o_d
        _turn(first, second, cos, sin, target, o_d, half, tile, False)
    cos, sin = _halves(key_angles, u_b, u_h, u_n, u_d, row, head, tokens, pairs, half, tile, WIDE)
    first, second = _halves(k, k_b, k_h, k_n, k_d, row, head, tokens, pairs, half, tile, WIDE)
    _turn(
        first,
        second,
        cos,
        sin,
        k_out + row * p_b + head * p_h + tokens[:, None] * p_n + pairs[None, :] * p_d,
        p_d,
        half,
        tile,
        False,
    )


@triton.jit
def _rotate_backward(
    dq,
    dk,
    q,
    k,
    angles,
    key_angles,
    dq_out,
    dk_out,
    grad_angles,
    length,
    half,
    groups,
    e_b,
    e_h,
    e_g,
    e_n,
    e_d,
    f_b,
    f_h,
    f_n,
    f_d,
    q_b,
    q_h,
    q_g,
    q_n,
    q_d,
    k_b,
    k_h,
    k_n,
    k_d,
    t_b,
    t_h,
    t_n,
    t_d,
    u_b,
    u_h,
    u_n,
    u_d,
    o_b,
    o_h,
    o_g,
    o_n,
    o_d,
    p_b,
    p_h,
    p_n,
    p_d,
    ANGLES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WIDE: tl.constexpr,
):
    row, head, tokens, pairs, tile = _tile(length, half, BLOCK_N, BLOCK_D)
    cos, sin = _halves(angles, t_b, t_h, t_n, t_d, row, head, tokens, pairs, half, tile, WIDE)
    grad_cos = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float64 if WIDE else tl.float32)
    grad_sin = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float64 if WIDE else tl.float32)
    for g in range(groups):  # dq = dy (a - i b); d(a + i b) += dy conj(q), summed over the group
        first, second = _halves(dq + g * e_g, e_b, e_h, e_n, e_d, row, head, tokens, pairs, half, tile, WIDE)
        target = dq_out + g * o_g + row * o_b + head * o_h + tokens[:, None] * o_n + pairs[None, :] * o_d
        _turn(first, second, cos, sin, target, o_d, half, tile, True)
        if ANGLES:
            x_first, x_second = _halves(q + g * q_g, q_b, q_h, q_n, q_d, row, head, tokens, pairs, half, tile, WIDE)
            grad_cos += first * x_first + second * x_second
            grad_sin += second * x_first - first * x_second
    cos, sin = _halves(key_angles, u_b, u_h, u_n, u_d, row, head, tokens, pairs, half, tile, WIDE)
    first, second = _halves(dk, f_b, f_h, f_n, f_d, row, head, tokens, pairs, half, tile, WIDE)
    _turn(
        first,
        second,
        cos,
        sin,
        dk_out + row * p_b + head * p_h + tokens[:, None] * p_n + pairs[None, :] * p_d,
        p_d,
        half,
        tile,
        True,
    )
    if ANGLES:  # and the key's share; written once, (B, Hkv, N, d) contiguous, [a | b]
        x_first, x_second = _halves(k, k_b, k_h, k_n, k_d, row, head, tokens, pairs, half, tile, WIDE)
        grad_cos += first * x_first + second * x_second
        grad_sin += second * x_first - first * x_second
        at = ((row * tl.num_programs(1) + head) * length + tokens[:, None]) * (2 * half) + pairs[None, :]
        tl.store(grad_angles + at, grad_cos, mask=tile)
        tl.store(grad_angles + at + half, grad_sin, mask=tile)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Queries (B, H, N, d) as (B, Hkv, G, N, d): the query heads of each KV head together (a view)."""
    return q.unflatten(1, (kv_heads, -1))


def _spread(angles: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Angles (B or 1, Hkv or 1, N, d) broadcast to k's shape (stride 0 where they broadcast)."""
    return angles.expand(k.shape)


def takes(q: torch.Tensor, k: torch.Tensor, angles: torch.Tensor, key_angles: torch.Tensor) -> bool:
    """Whether the kernels take this call: q (B, H, N, d) and k (B, Hkv, N, d) with H a multiple of Hkv and an even
    d, angles of k's rank that broadcast into it, and keys' own angles only where no angle needs a gradient."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[-1] % 2 or q.shape[1] % k.shape[1]:
        return False
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        return False
    if key_angles is not angles and (angles.requires_grad or key_angles.requires_grad):
        return False
    return all(
        table.dim() == 4 and all(size in (1, full) for size, full in zip(table.shape, k.shape))
        for table in (angles, key_angles)
    )


def _launch(kernel, k: torch.Tensor, wide: bool, *args, **constants) -> None:
    """`kernel` over k (B, Hkv, N, d): a program per block of tokens, KV head and batch row."""
    batch, kv_heads, length, width = k.shape
    grid = (triton.cdiv(length, BLOCK_TOKENS), kv_heads, batch)
    kernel[grid](*args, BLOCK_N=BLOCK_TOKENS, BLOCK_D=triton.next_power_of_2(width // 2), WIDE=wide, **constants)


class KernelRotation(torch.autograd.Function):
    """`rotate_reference(q, k, angles, key_angles)` through the kernels, written in `dtype` where given (else the
    promoted dtype, as the reference). Keeps q and k only where the angles need a gradient, as autograd through the
    reference keeps them. Differentiable once."""

    @staticmethod
    def forward(ctx, q, k, angles, key_angles, dtype=None):
        batch, kv_heads, length, width = k.shape
        q_out = torch.empty_like(q, dtype=dtype or torch.promote_types(q.dtype, angles.dtype))
        k_out = torch.empty_like(k, dtype=dtype or torch.promote_types(k.dtype, key_angles.dtype))
        grouped, out = _grouped(q, kv_heads), _grouped(q_out, kv_heads)
        table, key_table = _spread(angles, k), _spread(key_angles, k)
        wide = torch.float64 in (q.dtype, k.dtype, angles.dtype, key_angles.dtype)
        _launch(
            _rotate_forward,
            k,
            wide,
            grouped,
            k,
            table,
            key_table,
            out,
            k_out,
            length,
            width // 2,
            grouped.shape[2],
            *grouped.stride(),
            *k.stride(),
            *table.stride(),
            *key_table.stride(),
            *out.stride(),
            *k_out.stride(),
        )
        ctx.angles_need_grad = ctx.needs_input_grad[2]
        ctx.save_for_backward(*((q, k) if ctx.angles_need_grad else (None, None)), angles, key_angles)
        ctx.dtypes, ctx.wide = (q.dtype, k.dtype), wide
        return q_out, k_out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dq, dk):
        q, k, angles, key_angles = ctx.saved_tensors
        batch, kv_heads, length, width = dk.shape
        dq_out = torch.empty(dq.shape, dtype=ctx.dtypes[0], device=dq.device)
        dk_out = torch.empty(dk.shape, dtype=ctx.dtypes[1], device=dk.device)
        grad_angles = torch.empty(
            dk.shape if ctx.angles_need_grad else (1,),
            dtype=torch.float64 if ctx.wide else torch.float32,
            device=dk.device,
        )
        incoming, outgoing = _grouped(dq, kv_heads), _grouped(dq_out, kv_heads)
        sources = (_grouped(q, kv_heads), k) if ctx.angles_need_grad else (incoming, dk)
        table, key_table = _spread(angles, dk), _spread(key_angles, dk)
        _launch(
            _rotate_backward,
            dk,
            ctx.wide,
            incoming,
            dk,
            *sources,
            table,
            key_table,
            outgoing,
            dk_out,
            grad_angles,
            length,
            width // 2,
            incoming.shape[2],
            *incoming.stride(),
            *dk.stride(),
            *sources[0].stride(),
            *sources[1].stride(),
            *table.stride(),
            *key_table.stride(),
            *outgoing.stride(),
            *dk_out.stride(),
            ANGLES=ctx.angles_need_grad,
        )
        grad = grad_angles.sum_to_size(angles.shape).to(angles.dtype) if ctx.angles_need_grad else None
        return dq_out, dk_out, grad, None, None


def rotate_triton(
    q: torch.Tensor, k: torch.Tensor, angles: torch.Tensor, key_angles: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotate_reference(q, k, angles, key_angles)` through `KernelRotation`, in `dtype` where given."""
    return KernelRotation.apply(q, k, angles, key_angles, dtype)


__all__ = ["KernelRotation", "rotate_triton", "takes"]
