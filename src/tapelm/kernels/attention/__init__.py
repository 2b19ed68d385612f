"""One attention function for every encoding: softmax(q k^T * scale + bias) v with GQA, over a value stream that may
be wider than q and k (TAPE's [V | E] stream).

The reference (`naive`) is one SDPA call with q and k zero-padded to the value's width, or the explicit-softmax path
(single-token decoding, where it reads each cached key and value once and needs no padded copy of the cache;
`attn_implementation="eager"`). Measured on the CPU the padded call costs about 1.5x a V-only call, against 2-3x for a
naive concatenation or two calls. `attend_stream` returns the output of V and of the rest of the stream apart (the
output projection reads the first, TAPE's update the second).

Before its own candidates the dispatcher offers the call to the bias's own operation, where an encoding has one
(`RowBias.kernel`: FoX's and PaTH's kernels). Its candidates, in the order they are tried:
- "attention-blocks": any `RowBias`, a block of queries at a time inside activation checkpoints (each block's call
  through this dispatcher again, with its bias as a tensor);
- "attention-efficient": a bias that needs a gradient, as a float mask on CUDA's memory-efficient kernel;
- "attention-cpu-flash": a wider stream on the CPU through SDPA's CPU flash kernel, keeping less for the backward;
- "attention-unpadded": a wider stream on CUDA without padding q and k.
"""

from __future__ import annotations

import torch

from ...fast_paths import FastPaths
from .. import candidates, first
from . import blocks, unpadded
from .cpu_flash import CpuFlashAttention
from .efficient import bias_needs_grad, efficient_bias_attention
from .inputs import AttentionMask, RowBias, Segments, materialized, scale_rows, with_bias
from .naive import explicit_attention, padded_attention, sdpa_dtype

Outputs = tuple[torch.Tensor, torch.Tensor | None]


def _split(out: torch.Tensor, value_width: int) -> Outputs:
    """V's output and the rest's (None when there is no rest); the backward pass is one cat, not two zero-filled
    slices."""
    if out.shape[-1] == value_width:
        return out, None
    return tuple(out.split([value_width, out.shape[-1] - value_width], dim=-1))


def _blocks(q, k, stream, value_width, mask, bias, scale, paths):
    if not isinstance(bias, RowBias) or q.shape[-2] <= blocks.BIAS_BLOCK or not blocks.worth_it(q, k):
        return None

    def attend_rows(q_rows, k_rows, v_rows, rows_mask, rows_bias):
        return attend(q_rows, k_rows, v_rows, rows_mask, rows_bias, scale, paths)

    return _split(blocks.chunked_bias_attention(q, k, stream, mask, bias, attend_rows), value_width)


def _efficient(q, k, stream, value_width, mask, bias, scale, paths):
    if q.device.type != "cuda" or not bias_needs_grad(bias):
        return None
    out = efficient_bias_attention(q, k, stream, with_bias(mask, materialized(bias)), scale)
    return _split(out, value_width)


def _cpu_flash(q, k, stream, value_width, mask, bias, scale, paths):
    if stream.shape[-1] == value_width or not CpuFlashAttention.takes(q, mask, bias):
        return None
    dtype = sdpa_dtype(q, k, stream)
    float_mask = with_bias(mask, bias)
    if float_mask is not None and float_mask.dtype != torch.bool:
        float_mask = float_mask.to(dtype)
    return CpuFlashAttention.apply(
        q.to(dtype), k.to(dtype), stream.to(dtype), float_mask, mask.is_causal, scale, value_width
    )


def _unpadded(q, k, stream, value_width, mask, bias, scale, paths):
    if not unpadded.takes(q, stream):
        return None
    out = unpadded.unpadded_attention(q, k, stream, with_bias(mask, materialized(bias)), mask.is_causal, scale)
    return _split(out, value_width)


CANDIDATES = candidates(
    "attention", ("blocks", _blocks), ("efficient", _efficient), ("cpu-flash", _cpu_flash), ("unpadded", _unpadded)
)


def attend_stream(
    q: torch.Tensor,
    k: torch.Tensor,
    stream: torch.Tensor,
    value_width: int,
    mask: AttentionMask,
    bias,
    scale: float,
    paths: FastPaths,
    eager: bool = False,
    shared: torch.Tensor | None = None,
) -> Outputs:
    """softmax(q k^T * scale + bias) stream with GQA, split into the output of V, the stream's first `value_width`
    features (B, H, N, d), and of the rest (B, H, N, F), or None when the stream is V alone. q (B, H, N, dq),
    k (B, Hkv, T, dq), stream (B, Hkv, T, dv); a bias (B or 1, H, N, T), a tensor or a `RowBias`, needs an explicit
    `mask.valid`. `paths` are the fast paths on (`tapelm.fast_paths.resolve`); `eager` takes the explicit path.
    `shared` (B, 1, T, F), where given, is the rest of a stream that is V alone, the same for every KV head: the
    explicit path reads it once for all heads; the others read it joined to V (`joined_stream`)."""
    if eager or q.shape[-2] == 1:
        float_mask = with_bias(mask, materialized(bias))
        if shared is None:
            return _split(explicit_attention(q, k, stream, float_mask, mask.is_causal, scale)[0], value_width)
        values, probs = explicit_attention(q, k, stream, float_mask, mask.is_causal, scale)
        batch, heads, length, keys = probs.shape
        attended = probs.view(batch, 1, heads * length, keys) @ shared.to(probs.dtype)
        return values, attended.view(batch, heads, length, -1)
    stream = joined_stream(stream, shared)
    if isinstance(bias, RowBias) and bias.kernel is not None:
        out = bias.kernel(q, k, stream, mask, scale, paths)
        if out is not None:
            return _split(out, value_width)
    outputs = first(CANDIDATES, paths, q, k, stream, value_width, mask, bias, scale, paths)
    if outputs is not None:
        return outputs
    return _split(
        padded_attention(q, k, stream, with_bias(mask, materialized(bias)), mask.is_causal, scale), value_width
    )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    bias,
    scale: float,
    paths: FastPaths,
    eager: bool = False,
) -> torch.Tensor:
    """`attend_stream` of a value that is V alone: (B, H, N, dv)."""
    return attend_stream(q, k, v, v.shape[-1], mask, bias, scale, paths, eager)[0]


def joined_stream(stream: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """The value stream (B, Hkv, T, d) with a part `shared` (B, 1, T, F), the same for every KV head, joined to it
    (B, Hkv, T, d + F); the stream itself without one."""
    if shared is None:
        return stream
    return torch.cat([stream, shared.to(stream.dtype).expand(-1, stream.shape[1], -1, -1)], dim=-1)


def attend_with_probabilities(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, bias, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend` through the explicit path, also returning the attention probabilities (B, H, N, T)
    (`output_attentions=True`)."""
    return explicit_attention(q, k, v, with_bias(mask, materialized(bias)), mask.is_causal, scale)


def attend_registered(
    function,
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    bias,
    scale: float,
) -> torch.Tensor:
    """`attend` through an attention function registered with transformers' `AttentionInterface` (the signature
    transformers' own models call: `function(module, query, key, value, attention_mask, scaling=..., dropout=...,
    is_causal=...)` returning (B, N, H, dv) and the weights): the mask and bias given as one boolean or float mask
    (None: causal by `is_causal`, or every key). Returns (B, H, N, dv)."""
    out, _ = function(
        module, q, k, v, with_bias(mask, materialized(bias)), scaling=scale, dropout=0.0, is_causal=mask.is_causal
    )
    return out.transpose(1, 2)


__all__ = [
    "AttentionMask",
    "CANDIDATES",
    "RowBias",
    "Segments",
    "attend",
    "attend_registered",
    "attend_stream",
    "attend_with_probabilities",
    "explicit_attention",
    "joined_stream",
    "materialized",
    "padded_attention",
    "scale_rows",
]
