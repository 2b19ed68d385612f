"""TAPE's two updates of the positional state in one layer, in plain PyTorch: the reference.

After attention (`tape_attn_mixing="heads"`), E_g <- E_g + sum_h A_gh O_h, O_h the attention output of head h's
E-part and A the layer's Hkv x H mixing; after the MLP, E_g <- E_g + sum_h M_gh E_h with one Hkv x Hkv map M per
token (tapelm.kernels.state_mixing). The second update needs the first's result only, and neither feeds the hidden
states, so a layer can run both after its MLP."""

from __future__ import annotations

import torch

from ..state_mixing.naive import fused_when_compiled, mix_state_reference, plus_product


def in_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`, without a call where it already is (about 1 µs of dispatch, in each layer of a decoding step)."""
    return x if x.dtype == dtype else x.to(dtype)


def add_attended(state: torch.Tensor, attended: torch.Tensor, attn_mix: torch.Tensor) -> torch.Tensor:
    """state (B, Hkv, N, W) + sum_h attn_mix[g, h] attended[:, h] for attended (B, H, N, W): one (Hkv x H) @
    (H x N * W) product per sequence with the sum in the same call; a compiled decoding step as a broadcast product
    (`fused_when_compiled`)."""
    batch, heads, length, width = attended.shape
    if fused_when_compiled(length):
        return state + (in_dtype(attn_mix, attended.dtype)[None, :, :, None, None] * attended[:, None]).sum(2)
    weight = in_dtype(attn_mix, attended.dtype).expand(batch, -1, -1)
    rows = plus_product(state.reshape(batch, state.shape[1], -1), weight, attended.reshape(batch, heads, -1))
    return rows.view(state.shape)


def update_state_reference(
    state: torch.Tensor, attended: torch.Tensor, attn_mix: torch.Tensor, mix: torch.Tensor | None
) -> torch.Tensor:
    """The state after both updates (the MLP's only where `mix`, (B, N, Hkv, Hkv), is given)."""
    state = add_attended(state, attended, attn_mix)
    return state if mix is None else mix_state_reference(state, mix)


__all__ = ["add_attended", "in_dtype", "update_state_reference"]
