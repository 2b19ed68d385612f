"""SDPA's CPU flash kernel for a value stream wider than q and k (fast path "attention-cpu-flash")."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .inputs import AttentionMask, seen_keys


class CpuFlashAttention(torch.autograd.Function):
    """SDPA's CPU flash kernel for a value stream wider than q and k, q and k zero-padded to its width for the call
    as in the reference path. Returns the output of the first `value_width` features in the layout the output
    projection reads as a view (tokens outside heads) and of the rest contiguous. It keeps only the unpadded q and k
    for the backward pass, and those two outputs instead of the kernel's. In float32 and float64 the backward pass
    is `stream_attention_backward`, else the kernel's own backward (q and k padded again). Same function."""

    @staticmethod
    def takes(q: torch.Tensor, mask: AttentionMask, bias: torch.Tensor | None) -> bool:
        """A CPU tensor of a dtype the kernel takes, and no bias that needs a gradient (a learned bias)."""
        return (
            q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
            and (bias is None or (isinstance(bias, torch.Tensor) and not bias.requires_grad))
        )

    @staticmethod
    def forward(ctx, q, k, stream, attn_mask, is_causal, scale, value_width):
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # the kernel takes an additive mask in q's dtype
            attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill_(~attn_mask, float("-inf"))
        out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *_padded_to(stream.shape[-1], q, k), stream, 0.0, is_causal, attn_mask=attn_mask, scale=scale
        )
        values = out[..., :value_width].transpose(1, 2).contiguous().transpose(1, 2)
        extra = out[..., value_width:].contiguous()
        ctx.save_for_backward(q, k, stream, values, extra, logsumexp, attn_mask)
        ctx.is_causal, ctx.scale = is_causal, scale
        return values, extra

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_values, grad_extra):
        q, k, stream, values, extra, logsumexp, attn_mask = ctx.saved_tensors
        grad_values = torch.zeros_like(values) if grad_values is None else grad_values
        grad_extra = torch.zeros_like(extra) if grad_extra is None else grad_extra
        grad_out = torch.cat([grad_values, grad_extra], dim=-1)
        if q.dtype in (torch.float32, torch.float64):
            delta = (grad_values * values).sum(-1) + (grad_extra * extra).sum(-1)
            grad_q, grad_k, grad_stream = stream_attention_backward(
                grad_out, q, k, stream, logsumexp, delta, ctx.is_causal, ctx.scale, attn_mask
            )
            return grad_q, grad_k, grad_stream, None, None, None, None
        out = torch.cat([values, extra], dim=-1)
        grad_q, grad_k, grad_stream = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out,
            *_padded_to(stream.shape[-1], q, k),
            stream,
            out,
            logsumexp,
            0.0,
            ctx.is_causal,
            attn_mask=attn_mask,
            scale=ctx.scale,
        )
        return grad_q[..., : q.shape[-1]], grad_k[..., : k.shape[-1]], grad_stream, None, None, None, None


def _padded_to(width: int, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor zero-padded in its last dimension to `width`."""
    return [F.pad(x, (0, width - x.shape[-1])) for x in tensors]


STREAM_BACKWARD_BLOCK = 64
"""Queries per block of `stream_attention_backward`: for TAPE's stream 64 was the fastest of 32, 64 and 128 at bench
speed's small and large sizes (docs/speed/stream_backward.py)."""


def stream_attention_backward(
    grad_out,
    q,
    k,
    stream,
    logsumexp,
    delta,
    is_causal: bool,
    scale: float,
    attn_mask: torch.Tensor | None = None,
    block: int | None = None,
):
    """The gradients of q, k and the stream of softmax(q k^T * scale + attn_mask) stream (GQA; causal, every key,
    or an additive mask (B or 1, 1 or H, N, T) with -inf where a key is hidden), given the output's gradient, the
    forward pass's log-sum-exp per query (B, H, N) and delta = rowsum(grad_out * out) (B, H, N). A block of queries
    at a time, over the keys up to the last one it sees: the probabilities are made again from q k^T at q's width,
    then dS = P * (grad_out stream^T - delta), dq = scale dS k, dk = scale dS^T q, dstream = P^T grad_out. Each
    block's products run over the G query heads of a KV head at once (no copies of k or the stream). A query that
    sees no key has probabilities 0, as in the flash kernel (whose log-sum-exp is 0 there)."""
    block = block or STREAM_BACKWARD_BLOCK
    length, (batch, kv_heads, keys, width) = q.shape[2], stream.shape
    groups, rows = q.shape[1] // kv_heads, batch * kv_heads
    q_g, grad_g = _by_kv_head(q, kv_heads), _by_kv_head(grad_out, kv_heads)
    minus_lse = _by_kv_head(-logsumexp.to(q.dtype)[..., None], kv_heads)
    minus_delta = _by_kv_head(-delta[..., None], kv_heads)
    k_rows, stream_rows = k.reshape(rows, keys, -1), stream.reshape(rows, keys, width)
    grad_q = torch.empty_like(q_g)
    grad_k, grad_stream = torch.zeros_like(k_rows), torch.zeros_like(stream_rows)
    for start in range(0, length, block):
        end = min(start + block, length)
        if attn_mask is None:
            seen = min(end, keys) if is_causal else keys
        else:
            seen = seen_keys(attn_mask[..., start:end, :] > float("-inf"))
        q_block, grad_block = q_g[:, :, start:end].flatten(1, 2), grad_g[:, :, start:end].flatten(1, 2)
        probs = torch.baddbmm(
            minus_lse[:, :, start:end].flatten(1, 2), q_block, k_rows[:, :seen].transpose(1, 2), alpha=scale
        )
        if attn_mask is not None:  # (B or 1, 1 or H, n, seen) added over (B, Hkv, G, n, seen) by broadcasting
            rows_mask = attn_mask[..., start:end, :seen]
            rows_mask = rows_mask.unflatten(1, (kv_heads, groups)) if rows_mask.shape[1] > 1 else rows_mask.unsqueeze(2)
            probs.view(batch, kv_heads, groups, end - start, seen).add_(rows_mask)
        probs.exp_()
        if is_causal:  # keys after each query, within the block's own span
            later = torch.ones(end - start, seen - start, dtype=torch.bool, device=q.device).triu(1)
            probs.view(rows, groups, end - start, seen)[..., start:].masked_fill_(later, 0.0)
        grad_stream[:, :seen].baddbmm_(probs.transpose(1, 2), grad_block)
        grad_logits = probs.mul_(
            torch.baddbmm(minus_delta[:, :, start:end].flatten(1, 2), grad_block, stream_rows[:, :seen].transpose(1, 2))
        )
        grad_q[:, :, start:end] = torch.bmm(grad_logits, k_rows[:, :seen]).view(rows, groups, end - start, -1)
        grad_k[:, :seen].baddbmm_(grad_logits.transpose(1, 2), q_block)
    return (grad_q.mul_(scale).view(q.shape), grad_k.mul_(scale).view(k.shape), grad_stream.view(stream.shape))


def _by_kv_head(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, N, ...) -> (B * Hkv, H / Hkv, N, ...): the query heads of each KV head together."""
    return x.unflatten(1, (kv_heads, -1)).flatten(0, 1)


__all__ = ["CpuFlashAttention", "STREAM_BACKWARD_BLOCK", "stream_attention_backward"]
