"""`update_state_reference` as Triton kernels (fast path "state-update-triton"): one program per token reads its
Hkv x W state, its H x W attention output of E, the Hkv x H head mixing and its Hkv x Hkv map once, and writes
(I + M)(E + A O) once; the backward pass writes the state's and the attention output's gradients and the map's, and
the head mixing's per token (summed after). The reference writes the attention branch's product in the attention's
dtype, its sum with the state, and the MLP branch's copy, product and sum: about four passes over the state each way.
Accumulates in float32 (float64 for float64 inputs). Runs on CUDA, and on the CPU under Triton's interpreter
(`TRITON_INTERPRET=1`), which is how CI tests it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _token(length, width, KV: tl.constexpr, KV_P2: tl.constexpr, BLOCK_W: tl.constexpr):
    """This program's token (b, n), the tile's KV-head and column indices and its mask."""
    token = tl.program_id(0).to(tl.int64)
    kv, cols = tl.arange(0, KV_P2), tl.arange(0, BLOCK_W)
    return token, token // length, token % length, kv, cols, (kv[:, None] < KV) & (cols[None, :] < width)


@triton.jit
def _load(pointer, offsets, mask, WIDE: tl.constexpr):
    """Values at `pointer + offsets` (zero where masked) in the accumulation type: float64 or float32."""
    return tl.load(pointer + offsets, mask=mask, other=0.0).to(tl.float64 if WIDE else tl.float32)


@triton.jit
def _row(tile, rows, index):
    """Row `index` of a register tile whose row indices are `rows`."""
    return tl.sum(tl.where(rows[:, None] == index, tile, 0.0), axis=0)


@triton.jit
def _attended_sum(
    state,
    att,
    amix,
    b,
    n,
    kv,
    cols,
    tile,
    width,
    s_b,
    s_h,
    s_n,
    s_w,
    a_b,
    a_h,
    a_n,
    a_w,
    x_g,
    x_h,
    KV: tl.constexpr,
    HEADS: tl.constexpr,
    WIDE: tl.constexpr,
):
    """E + A O for one token: (KV_P2, BLOCK_W)."""
    acc = _load(state + b * s_b + n * s_n, kv[:, None] * s_h + cols[None, :] * s_w, tile, WIDE)
    for h in tl.static_range(HEADS):
        weight = _load(amix, kv * x_g + h * x_h, kv < KV, WIDE)
        source = _load(att + b * a_b + n * a_n, h * a_h + cols * a_w, cols < width, WIDE)
        acc += weight[:, None] * source[None, :]
    return acc


@triton.jit
def _update_forward(
    state,
    att,
    amix,
    mix,
    out,
    length,
    width,
    s_b,
    s_h,
    s_n,
    s_w,
    a_b,
    a_h,
    a_n,
    a_w,
    x_g,
    x_h,
    m_b,
    m_n,
    m_g,
    m_h,
    o_b,
    o_h,
    o_n,
    KV: tl.constexpr,
    KV_P2: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    HAS_MIX: tl.constexpr,
    WIDE: tl.constexpr,
):
    _, b, n, kv, cols, tile = _token(length, width, KV, KV_P2, BLOCK_W)
    acc = _attended_sum(
        state, att, amix, b, n, kv, cols, tile, width, s_b, s_h, s_n, s_w, a_b, a_h, a_n, a_w, x_g, x_h, KV, HEADS, WIDE
    )
    if HAS_MIX:  # (I + M) acc
        mixed = acc
        for h in tl.static_range(KV):
            column = _load(mix + b * m_b + n * m_n, kv * m_g + h * m_h, kv < KV, WIDE)
            mixed += column[:, None] * _row(acc, kv, h)[None, :]
        acc = mixed
    tl.store(out + b * o_b + n * o_n + kv[:, None] * o_h + cols[None, :], acc.to(out.dtype.element_ty), mask=tile)


@triton.jit
def _update_backward(
    grad,
    state,
    att,
    amix,
    mix,
    grad_state,
    grad_att,
    grad_mix,
    grad_amix,
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
    a_b,
    a_h,
    a_n,
    a_w,
    x_g,
    x_h,
    m_b,
    m_n,
    m_g,
    m_h,
    gs_b,
    gs_h,
    gs_n,
    ga_b,
    ga_h,
    ga_n,
    gm_b,
    gm_n,
    gm_g,
    KV: tl.constexpr,
    KV_P2: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    HAS_MIX: tl.constexpr,
    WIDE: tl.constexpr,
):
    token, b, n, kv, cols, tile = _token(length, width, KV, KV_P2, BLOCK_W)
    incoming = _load(grad + b * d_b + n * d_n, kv[:, None] * d_h + cols[None, :] * d_w, tile, WIDE)
    upstream = incoming  # the gradient of E + A O
    if HAS_MIX:
        summed = _attended_sum(
            state,
            att,
            amix,
            b,
            n,
            kv,
            cols,
            tile,
            width,
            s_b,
            s_h,
            s_n,
            s_w,
            a_b,
            a_h,
            a_n,
            a_w,
            x_g,
            x_h,
            KV,
            HEADS,
            WIDE,
        )
        for h in tl.static_range(KV):  # d M[g, h] = <d out_g, (E + A O)_h>; d (E + A O)_h += M[g, h] d out_g
            tl.store(
                grad_mix + b * gm_b + n * gm_n + kv * gm_g + h,
                tl.sum(incoming * _row(summed, kv, h)[None, :], axis=1),
                mask=kv < KV,
            )
            row = _load(mix + b * m_b + n * m_n, h * m_g + kv * m_h, kv < KV, WIDE)
            upstream += row[:, None] * _row(incoming, kv, h)[None, :]
    tl.store(grad_state + b * gs_b + n * gs_n + kv[:, None] * gs_h + cols[None, :], upstream, mask=tile)
    for h in tl.static_range(HEADS):  # d O_h = sum_g A[g, h] d E_g; d A[g, h] += <d E_g, O_h>
        weight = _load(amix, kv * x_g + h * x_h, kv < KV, WIDE)
        tl.store(
            grad_att + b * ga_b + n * ga_n + h * ga_h + cols,
            tl.sum(weight[:, None] * upstream, axis=0).to(grad_att.dtype.element_ty),
            mask=cols < width,
        )
        source = _load(att + b * a_b + n * a_n, h * a_h + cols * a_w, cols < width, WIDE)
        tl.store(
            grad_amix + token * KV * HEADS + kv * HEADS + h, tl.sum(upstream * source[None, :], axis=1), mask=kv < KV
        )


def _constants(state: torch.Tensor, attended: torch.Tensor, mix: torch.Tensor | None, wide: bool) -> dict:
    kv_heads, width = state.shape[1], state.shape[3]
    return {
        "KV": kv_heads,
        "KV_P2": triton.next_power_of_2(kv_heads),
        "HEADS": attended.shape[1],
        "BLOCK_W": triton.next_power_of_2(width),
        "HAS_MIX": mix is not None,
        "WIDE": wide,
    }


class StateUpdate(torch.autograd.Function):
    """`update_state_reference(state, attended, attn_mix, mix)` through the kernels (`mix` None: the attention
    branch alone). Keeps its four inputs for the backward pass, as autograd through the reference keeps them (and
    the first update's result, which this recomputes). Differentiable once."""

    @staticmethod
    def forward(ctx, state, attended, attn_mix, mix):
        batch, kv_heads, length, width = state.shape
        dtypes = [state.dtype, attended.dtype] + ([] if mix is None else [mix.dtype])
        wide = torch.float64 in dtypes
        out = torch.empty(state.shape, dtype=torch.float64 if wide else state.dtype, device=state.device)
        maps = attended if mix is None else mix  # a pointer the kernel does not read without a map
        _update_forward[(batch * length,)](
            state,
            attended,
            attn_mix,
            maps,
            out,
            length,
            width,
            *state.stride(),
            *attended.stride(),
            *attn_mix.stride(),
            *_maps_strides(mix),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            **_constants(state, attended, mix, wide),
        )
        ctx.save_for_backward(state, attended, attn_mix, mix)
        ctx.wide = wide
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        state, attended, attn_mix, mix = ctx.saved_tensors
        batch, kv_heads, length, width = state.shape
        accumulate = torch.float64 if ctx.wide else torch.float32
        grad_state = torch.empty(state.shape, dtype=accumulate, device=state.device)
        grad_attended = torch.empty(attended.shape, dtype=attended.dtype, device=state.device)
        grad_mix = torch.empty(mix.shape if mix is not None else (1, 1, 1), dtype=accumulate, device=state.device)
        grad_attn_mix = torch.empty(batch * length, kv_heads, attended.shape[1], dtype=accumulate, device=state.device)
        maps = attended if mix is None else mix
        _update_backward[(batch * length,)](
            grad,
            state,
            attended,
            attn_mix,
            maps,
            grad_state,
            grad_attended,
            grad_mix,
            grad_attn_mix,
            length,
            width,
            *grad.stride(),
            *state.stride(),
            *attended.stride(),
            *attn_mix.stride(),
            *_maps_strides(mix),
            grad_state.stride(0),
            grad_state.stride(1),
            grad_state.stride(2),
            grad_attended.stride(0),
            grad_attended.stride(1),
            grad_attended.stride(2),
            grad_mix.stride(0),
            grad_mix.stride(1),
            grad_mix.stride(2),
            **_constants(state, attended, mix, ctx.wide),
        )
        return (
            grad_state.to(state.dtype),
            grad_attended,
            grad_attn_mix.sum(0).to(attn_mix.dtype),
            None if mix is None else grad_mix.to(mix.dtype),
        )


def _maps_strides(mix: torch.Tensor | None) -> tuple[int, int, int, int]:
    return (0, 0, 0, 0) if mix is None else mix.stride()


def update_state_triton(
    state: torch.Tensor, attended: torch.Tensor, attn_mix: torch.Tensor, mix: torch.Tensor | None
) -> torch.Tensor:
    """`update_state_reference(state, attended, attn_mix, mix)` through `StateUpdate`."""
    return StateUpdate.apply(state, attended, attn_mix, mix)


__all__ = ["StateUpdate", "update_state_triton"]
