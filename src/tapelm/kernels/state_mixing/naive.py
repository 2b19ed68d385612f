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
    states = state.transpose(1, 2)
    if 0 in states.stride():
        states = states.contiguous()
    return torch.matmul(mix, states).transpose(1, 2)


def mix_state_reference(state: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """The state after the update: state + `state_delta(state, mix)`."""
    return state + state_delta(state, mix)


__all__ = ["fused_when_compiled", "mix_state_reference", "state_delta"]
