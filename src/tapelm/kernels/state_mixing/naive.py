"""The reference: TAPE's per-token mixing of the positional state across KV heads in plain PyTorch."""

from __future__ import annotations

import torch


def state_delta(state: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """delta[b, g, n] = sum_h mix[b, n, g, h] state[b, h, n]; state (B, Hkv, N, W), mix (B, N, Hkv, Hkv).

    One (Hkv x Hkv) @ (Hkv x W) product per token: on the CPU 3-5x faster than a broadcast product summed over
    heads. A state expanded over heads (the first layer's E0) is copied first: with a zero stride the CPU's batched
    product copies each token's matrix apart, about 14x slower at bench speed's small size. A single token (a
    decoding step) takes the broadcast product, which a compiled decode step fuses with the update's elementwise
    work instead of launching a batched product."""
    if state.shape[-2] == 1:
        return (mix[:, 0, :, :, None] * state[:, None, :, 0, :]).sum(2)[:, :, None]
    states = state.transpose(1, 2)
    if 0 in states.stride():
        states = states.contiguous()
    return torch.matmul(mix, states).transpose(1, 2)


def mix_state_reference(state: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """The state after the update: state + `state_delta(state, mix)`."""
    return state + state_delta(state, mix)


__all__ = ["mix_state_reference", "state_delta"]
