"""The reference: TAPE's per-token mixing of the positional state across KV heads in plain PyTorch."""

from __future__ import annotations

import torch


def fused_when_compiled(tokens: int) -> bool:
    """Whether a product over heads is written as a broadcast product summed over heads: in a decoding step (one
    token) being compiled, where the compiler fuses it with the elementwise work around it instead of launching a
    batched product (with TAPE's head mixing and maps alike, 158 kernels a step at the paper's size instead of 213:
    docs/SPEED.md). Eagerly the batched product runs fewer operations."""
    return tokens == 1 and torch.compiler.is_compiling()


def state_delta(state: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """delta[b, g, n] = sum_h mix[b, n, g, h] state[b, h, n]; state (B, Hkv, N, W), mix (B, N, Hkv, Hkv).

    One (Hkv x Hkv) @ (Hkv x W) product per token: on the CPU 3-5x faster than a broadcast product summed over
    heads. A state expanded over heads (the first layer's E0) is copied first: with a zero stride the CPU's batched
    product copies each token's matrix apart, about 14x slower at bench speed's small size. A compiled decoding
    step takes the broadcast product (`fused_when_compiled`)."""
    if fused_when_compiled(state.shape[-2]):
        return (mix[:, 0, :, :, None] * state[:, None, :, 0, :]).sum(2)[:, :, None]
    return _by_token(torch.bmm(mix.flatten(0, 1), _token_rows(state)), state)


def mix_state_reference(state: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """The state after the update: state + `state_delta(state, mix)`, the sum in the product's call
    (`plus_product`). One token's update takes the fewest calls: a decoding step runs it in every layer."""
    batch, kv_heads, length, width = state.shape
    if fused_when_compiled(length):
        return state + state_delta(state, mix)
    if length == 1:  # a decoding step: the state is its one token's rows (copied where expanded over heads)
        rows = state.reshape(batch, kv_heads, width)
        return plus_product(rows, mix.view(batch, kv_heads, kv_heads), rows).view(state.shape)
    rows = _token_rows(state)
    return _by_token(plus_product(rows, mix.flatten(0, 1), rows), state)


def plus_product(total: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """total + first @ second (batched) as one operation (`baddbmm`): a decoding step's few features take less time
    in one call than in two. Under autocast, or with a product of another dtype than total's, as two: the product in
    its dtype, the sum in total's promoted with it (autocast would run `baddbmm`, the sum included, in half precision,
    rounding the state every layer)."""
    if torch.is_autocast_enabled(total.device.type) or second.dtype != total.dtype:
        return total + torch.bmm(first, second)
    return torch.baddbmm(total, first, second)


def _token_rows(state: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, N, W) -> (B * N, Hkv, W), copied where a zero stride (a state expanded over heads) would remain."""
    rows = state.transpose(1, 2)
    return (rows.contiguous() if 0 in rows.stride() else rows).flatten(0, 1)


def _by_token(rows: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """(B * N, Hkv, W) -> the shape of `state`, (B, Hkv, N, W)."""
    batch, kv_heads, length, width = state.shape
    return rows.view(batch, length, kv_heads, width).transpose(1, 2)


__all__ = ["fused_when_compiled", "mix_state_reference", "plus_product", "state_delta"]
