"""`mix_state_reference` as Triton kernels: one program per token reads its Hkv x W state and its Hkv x Hkv map once
and writes the updated state, where the reference makes the state's transposed copy, a batched product of tiny
matrices and a sum (three passes over the state, and as many again in the backward pass). Accumulates in float32
(float64 for float64 inputs). Runs on CUDA, and on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`),
which is how CI tests it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _token(length, width, HEADS: tl.constexpr, HEADS_P2: tl.constexpr, BLOCK_W: tl.constexpr):
    """This program's token (b, n), the tile's head and column indices and its mask."""
    token = tl.program_id(0).to(tl.int64)
    heads, cols = tl.arange(0, HEADS_P2), tl.arange(0, BLOCK_W)
    return token // length, token % length, heads, cols, (heads[:, None] < HEADS) & (cols[None, :] < width)


@triton.jit
def _load(pointer, offsets, mask, WIDE: tl.constexpr):
    """Values at `pointer + offsets` (zero where masked) in the accumulation type: float64 or float32."""
    return tl.load(pointer + offsets, mask=mask, other=0.0).to(tl.float64 if WIDE else tl.float32)


@triton.jit
def _mix_forward(
    state,
    mix,
    out,
    length,
    width,
    s_b,
    s_h,
    s_n,
    s_w,
    m_b,
    m_n,
    m_g,
    m_h,
    o_b,
    o_h,
    o_n,
    HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    BLOCK_W: tl.constexpr,
    WIDE: tl.constexpr,
):
    b, n, heads, cols, tile = _token(length, width, HEADS, HEADS_P2, BLOCK_W)
    state_row, mix_row = state + b * s_b + n * s_n, mix + b * m_b + n * m_n
    acc = _load(state_row, heads[:, None] * s_h + cols[None, :] * s_w, tile, WIDE)
    for h in tl.static_range(HEADS):
        column = _load(mix_row, heads * m_g + h * m_h, heads < HEADS, WIDE)
        source = _load(state_row, h * s_h + cols * s_w, cols < width, WIDE)
        acc += column[:, None] * source[None, :]
    tl.store(out + b * o_b + n * o_n + heads[:, None] * o_h + cols[None, :], acc.to(out.dtype.element_ty), mask=tile)


@triton.jit
def _mix_backward(
    grad,
    state,
    mix,
    grad_state,
    grad_mix,
    length,
    width,
    d_b,
    d_h,
    d_n,
    d_w,
    s_b,
    s_h,
    s_n,
    s_w,
    m_b,
    m_n,
    m_g,
    m_h,
    gs_b,
    gs_h,
    gs_n,
    gm_b,
    gm_n,
    gm_g,
    HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    BLOCK_W: tl.constexpr,
    WIDE: tl.constexpr,
):
    b, n, heads, cols, tile = _token(length, width, HEADS, HEADS_P2, BLOCK_W)
    grad_row, mix_row = grad + b * d_b + n * d_n, mix + b * m_b + n * m_n
    acc = _load(grad_row, heads[:, None] * d_h + cols[None, :] * d_w, tile, WIDE)
    source = _load(state + b * s_b + n * s_n, heads[:, None] * s_h + cols[None, :] * s_w, tile, WIDE)
    for g in tl.static_range(HEADS):
        grad_g = _load(grad_row, g * d_h + cols * d_w, cols < width, WIDE)
        row = _load(mix_row, g * m_g + heads * m_h, heads < HEADS, WIDE)
        acc += row[:, None] * grad_g[None, :]  # d state_h += mix[g, h] d out_g
        tl.store(
            grad_mix + b * gm_b + n * gm_n + g * gm_g + heads,
            tl.sum(source * grad_g[None, :], axis=1),
            mask=heads < HEADS,
        )  # d mix[g, h] = <d out_g, state_h>
    tl.store(grad_state + b * gs_b + n * gs_n + heads[:, None] * gs_h + cols[None, :], acc, mask=tile)


def _constants(state: torch.Tensor) -> dict:
    heads, width = state.shape[1], state.shape[3]
    return {
        "HEADS": heads,
        "HEADS_P2": triton.next_power_of_2(heads),
        "BLOCK_W": triton.next_power_of_2(width),
        "WIDE": state.dtype == torch.float64,
    }


class StateMixing(torch.autograd.Function):
    """state + delta (`naive.mix_state_reference`) through the kernels. Keeps state and mix for the backward pass,
    as autograd through the reference does. Differentiable once."""

    @staticmethod
    def forward(ctx, state, mix):
        batch, heads, length, width = state.shape
        out = torch.empty(state.shape, dtype=torch.promote_types(state.dtype, mix.dtype), device=state.device)
        _mix_forward[(batch * length,)](
            state,
            mix,
            out,
            length,
            width,
            *state.stride(),
            *mix.stride(),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            **_constants(state),
        )
        ctx.save_for_backward(state, mix)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        state, mix = ctx.saved_tensors
        batch, heads, length, width = state.shape
        wide = torch.float64 if state.dtype == torch.float64 else torch.float32
        grad_state = torch.empty(state.shape, dtype=wide, device=state.device)
        grad_mix = torch.empty(mix.shape, dtype=wide, device=state.device)
        _mix_backward[(batch * length,)](
            grad,
            state,
            mix,
            grad_state,
            grad_mix,
            length,
            width,
            *grad.stride(),
            *state.stride(),
            *mix.stride(),
            grad_state.stride(0),
            grad_state.stride(1),
            grad_state.stride(2),
            grad_mix.stride(0),
            grad_mix.stride(1),
            grad_mix.stride(2),
            **_constants(state),
        )
        return grad_state.to(state.dtype), grad_mix.to(mix.dtype)


def mix_state_triton(state: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """`mix_state_reference(state, mix)` through `StateMixing`."""
    return StateMixing.apply(state, mix)


__all__ = ["StateMixing", "mix_state_triton"]
