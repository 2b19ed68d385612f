"""One attention function for every encoding: PyTorch SDPA, or an explicit-softmax reference path.

The value tensor may be wider than q and k (TAPE's [V | E] stream). The reference path zero-pads q and k to the
value's width and makes one SDPA call: extra zero dimensions of q and k leave every logit unchanged (the scale is
passed explicitly). SDPA's CPU flash kernel and CUDA's flash kernel need q, k and v of one width (otherwise the CPU
falls back silently to the slow math kernel); measured on the CPU the padded call costs about 1.5x a V-only call,
against 2-3x for a naive concatenation or two calls. `attend_stream` returns the output of V and of the rest of
the stream apart (the output projection reads the first, TAPE's update the second). Fast paths compute the same
function (`tapelm.fast_paths`):

- on the CPU, `CpuFlashAttention` calls the same flash kernel. For a wider stream it keeps only the unpadded q and k
  for the backward pass and writes the two outputs in the layouts their readers take without a copy (about 10 MB
  less memory a layer at bench speed's small size). In float32 and float64 the backward pass of a wider stream
  (`stream_attention_backward`) is plain matrix products over blocks of queries, with q k^T at q's width where the
  flash kernel's backward pads q and k. A value as wide as q keeps the kernel's own backward, which has no padding
  to remove; the blockwise pass was not reliably faster there (docs/speed/stream_backward.py);
- on CUDA, the attention call without padding, on the kernels that take a wider value (cuDNN, memory-efficient);
- everywhere, for a logit bias given as a `RowBias` (one the encoding can build for any block of queries: T5, FIRE,
  CoPE, FoX, PaTH), attention a block of queries at a time, each block's bias built inside an activation checkpoint, so
  no N x T tensor per head is kept for the backward pass (`chunked_bias_attention`);
- on CUDA with fla installed, FoX and PaTH through fla's kernels (`tapelm.kernels.fla`, given as the bias's
  `kernel`; off until a GPU run passes).

Single-token decoding takes the explicit path: one row of logits per head, each cached key and value read once, no
padded copy of the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from .fast_paths import enabled


@dataclass
class AttentionMask:
    """Which keys each query may see: `valid` (B, 1, N, T) booleans, or None with `is_causal` meaning SDPA's own
    causal mask (no padding, no cache offset) and `is_causal=False` meaning every key."""

    valid: torch.Tensor | None
    is_causal: bool


class RowBias:
    """An additive logit bias (B or 1, H, N, T) given by a function of a block of queries: `rows(start, end, keys)` is
    bias[..., start:end, :keys] (keys None: every key). Attention can build it a block at a time (and again in the
    backward pass), over the keys that block sees, instead of keeping all of it; `full()` is the whole tensor (the
    reference path, explicit attention, a short sequence).
    `kernel(q, k, v, mask, scale)`, where given, is the same attention through an encoding's own kernel (fast path
    "fla-kernels"), returning None where that kernel cannot take the call."""

    def __init__(self, rows: Callable[[int, int, int | None], torch.Tensor], queries: int,
                 kernel: Callable[..., torch.Tensor | None] | None = None):
        self.rows, self.queries, self.kernel = rows, queries, kernel

    def full(self) -> torch.Tensor:
        return self.rows(0, self.queries, None)

    @staticmethod
    def add(first, second):
        """The sum of two biases, each a tensor, a `RowBias` or None."""
        if first is None or second is None:
            return second if first is None else first
        if not isinstance(first, RowBias) and not isinstance(second, RowBias):
            return first + second
        queries = first.queries if isinstance(first, RowBias) else second.queries
        return RowBias(lambda start, end, keys: _rows(first, start, end, keys) + _rows(second, start, end, keys),
                       queries)


def _rows(bias, start: int, end: int, keys: int | None) -> torch.Tensor:
    return bias.rows(start, end, keys) if isinstance(bias, RowBias) else bias[..., start:end, :keys]


def materialized(bias):
    """A bias as one tensor (None stays None)."""
    return bias.full() if isinstance(bias, RowBias) else bias


BIAS_BLOCK = 128
"""Queries per block of `chunked_bias_attention`: in single training steps timed at bench speed's small size, 128
was faster than 256 and than 64 for CoPE and FoX (not a committed measurement; docs/SPEED.md has the result)."""

AttentionFunction = Callable[..., torch.Tensor]
"""What a per-module attention override computes: `fn(q, k, v, mask, bias, scale) -> out`, with the shapes and meaning
of `attend` (q (B, H, N, dq), k (B, Hkv, T, dq), v (B, Hkv, T, dv), an `AttentionMask`, an optional additive bias
(B or 1, H, N, T), the logit scale); returns (B, H, N, dv)."""


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, bias: torch.Tensor | None,
           scale: float, eager: bool = False, fast_paths: str = "auto") -> torch.Tensor:
    """softmax(q k^T * scale + bias) v with GQA. q (B, H, N, dq), k (B, Hkv, T, dq), v (B, Hkv, T, dv);
    bias (B or 1, H, N, T) needs an explicit `mask.valid`. Returns (B, H, N, dv). `fast_paths` is the config's
    setting (`tapelm.fast_paths`); `bias` may be a `RowBias`."""
    if isinstance(bias, RowBias):
        if bias.kernel is not None and not eager and q.shape[-2] > 1 and enabled("fla-kernels", q.device, fast_paths):
            out = bias.kernel(q, k, v, mask, scale)
            if out is not None:
                return out
        if not eager and q.shape[-2] > BIAS_BLOCK and enabled("chunked-bias-attention", q.device, fast_paths):
            return chunked_bias_attention(q, k, v, mask, bias, scale, fast_paths)
        bias = bias.full()
    float_mask = _with_bias(mask, bias)
    if eager or q.shape[-2] == 1:
        return explicit_attention(q, k, v, float_mask, mask.is_causal, scale)[0]
    if v.shape[-1] > q.shape[-1] and q.device.type == "cuda" and enabled("cuda-unpadded-attention", q.device,
                                                                          fast_paths):
        return unpadded_attention(q, k, v, float_mask, mask.is_causal, scale)
    return padded_attention(q, k, v, float_mask, mask.is_causal, scale)


def attend_stream(q: torch.Tensor, k: torch.Tensor, stream: torch.Tensor, value_width: int, mask: AttentionMask,
                  bias: torch.Tensor | None, scale: float, eager: bool = False, fast_paths: str = "auto",
                  shared: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`attend` over a value stream whose first `value_width` features are V: the output of V (B, H, N, d) and of
    the rest of the stream (B, H, N, F), or None when the stream is V alone. `shared` (B, 1, T, F), where given, is
    the rest of a stream that is V alone, the same for every KV head: the explicit path (single-token decoding)
    reads it once for all heads; the others read it joined to V (`joined_stream`)."""
    if shared is not None:
        if not (eager or q.shape[-2] == 1):
            return attend_stream(q, k, joined_stream(stream, shared), value_width, mask, bias, scale, eager,
                                 fast_paths)
        values, probs = explicit_attention(q, k, stream, _with_bias(mask, materialized(bias)), mask.is_causal, scale)
        batch, heads, length, keys = probs.shape
        attended = probs.view(batch, 1, heads * length, keys) @ shared.to(probs.dtype)
        return values, attended.view(batch, heads, length, -1)
    if stream.shape[-1] == value_width:
        return attend(q, k, stream, mask, bias, scale, eager, fast_paths), None
    if (not eager and q.shape[-2] > 1 and enabled("cpu-flash-attention", q.device, fast_paths)
            and CpuFlashAttention.takes(q, mask, bias)):
        dtype = _sdpa_dtype(q, k, stream)
        float_mask = _with_bias(mask, bias)
        return CpuFlashAttention.apply(q.to(dtype), k.to(dtype), stream.to(dtype),
                                       float_mask if float_mask is None or float_mask.dtype == torch.bool
                                       else float_mask.to(dtype), mask.is_causal, scale, value_width)
    out = attend(q, k, stream, mask, bias, scale, eager, fast_paths)
    return out.split([value_width, out.shape[-1] - value_width], dim=-1)  # backward: one cat, not two zero-filled


def joined_stream(stream: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """The value stream (B, Hkv, T, d) with a part `shared` (B, 1, T, F), the same for every KV head, joined to it
    (B, Hkv, T, d + F); the stream itself without one."""
    if shared is None:
        return stream
    return torch.cat([stream, shared.to(stream.dtype).expand(-1, stream.shape[1], -1, -1)], dim=-1)


def chunked_bias_attention(q, k, v, mask: AttentionMask, bias: RowBias, scale: float, fast_paths: str):
    """`attend` a block of `BIAS_BLOCK` queries at a time over the keys up to the last one the block sees (a causal
    block skips the later keys), each block's bias built from its rows. With gradients each block runs inside an
    activation checkpoint: the backward pass builds the block's bias and attention again, so what is kept between
    the passes is q, k, v and the output, never an N x T tensor per head."""
    blocks = []
    for start in range(0, q.shape[-2], BIAS_BLOCK):
        end = min(start + BIAS_BLOCK, q.shape[-2])
        valid = mask.valid[..., start:end, :]
        keys = _seen_keys(valid)
        rows = AttentionMask(valid[..., :keys], False)

        def block(q_rows, start=start, end=end, rows=rows, keys=keys):
            return attend(q_rows, k[..., :keys, :], v[..., :keys, :], rows, bias.rows(start, end, keys), scale,
                          fast_paths=fast_paths)

        q_rows = q[..., start:end, :]
        blocks.append(checkpoint(block, q_rows, use_reentrant=False) if torch.is_grad_enabled() else block(q_rows))
    return torch.cat(blocks, dim=-2)


def _seen_keys(valid: torch.Tensor) -> int:
    """1 + the last key any query of `valid` (B, 1 or H, n, T) sees, at least 1 (T while compiling: no branch on
    data)."""
    if torch.compiler.is_compiling():
        return valid.shape[-1]
    seen = valid.flatten(0, -2).any(0).nonzero()
    return int(seen[-1]) + 1 if len(seen) else 1


def padded_attention(q, k, v, attn_mask, is_causal, scale):
    """The reference SDPA call: the narrower of q/k and v zero-padded to one width, the padding sliced off. Padded in
    the dtype SDPA computes in (under autocast, after the cast it would make itself: the same numbers, half the bytes
    of padding float32 tensors, forward and backward)."""
    width, value_width = max(q.shape[-1], v.shape[-1]), v.shape[-1]
    if width > min(q.shape[-1], v.shape[-1]):
        dtype = _sdpa_dtype(q, k, v)
        q, k, v = (F.pad(x.to(dtype), (0, width - x.shape[-1])) if x.shape[-1] < width else x for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[..., :value_width] if width > value_width else out


def unpadded_attention(q, k, v, attn_mask, is_causal, scale):
    """A value wider than q and k without padding, on the CUDA kernels that take it: cuDNN or memory-efficient, math
    as the last resort. Not cuDNN where keys are cached (more keys than queries): PyTorch builds a cuDNN graph for
    each new key length, so each decoding step would build one. Grouped KV heads are expanded for the kernels."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    backends = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    if k.shape[-2] == q.shape[-2]:
        backends.insert(0, SDPBackend.CUDNN_ATTENTION)
    with sdpa_kernel(backends):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


class CpuFlashAttention(torch.autograd.Function):
    """SDPA's CPU flash kernel for a value stream wider than q and k, q and k zero-padded to its width for the call
    as in the reference path. Returns the output of the first `value_width` features in the layout the output
    projection reads as a view (tokens outside heads) and of the rest contiguous. It keeps only the unpadded q and k
    for the backward pass, and those two outputs instead of the kernel's. In float32 and float64 the backward pass
    is `stream_attention_backward`, else the kernel's own backward (q and k padded again). Same function."""

    @staticmethod
    def takes(q: torch.Tensor, mask: AttentionMask, bias: torch.Tensor | None) -> bool:
        """A CPU tensor of a dtype the kernel takes, and no bias that needs a gradient (a learned bias)."""
        return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
                and (bias is None or (isinstance(bias, torch.Tensor) and not bias.requires_grad)))

    @staticmethod
    def forward(ctx, q, k, stream, attn_mask, is_causal, scale, value_width):
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # the kernel takes an additive mask in q's dtype
            attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill_(~attn_mask, float("-inf"))
        out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *_padded_to(stream.shape[-1], q, k), stream, 0.0, is_causal, attn_mask=attn_mask, scale=scale)
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
            grad_q, grad_k, grad_stream = stream_attention_backward(grad_out, q, k, stream, logsumexp, delta,
                                                                    ctx.is_causal, ctx.scale, attn_mask)
            return grad_q, grad_k, grad_stream, None, None, None, None
        out = torch.cat([values, extra], dim=-1)
        grad_q, grad_k, grad_stream = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, *_padded_to(stream.shape[-1], q, k), stream, out, logsumexp, 0.0, ctx.is_causal,
            attn_mask=attn_mask, scale=ctx.scale)
        return grad_q[..., : q.shape[-1]], grad_k[..., : k.shape[-1]], grad_stream, None, None, None, None


def _padded_to(width: int, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor zero-padded in its last dimension to `width`."""
    return [F.pad(x, (0, width - x.shape[-1])) for x in tensors]


STREAM_BACKWARD_BLOCK = 64
"""Queries per block of `stream_attention_backward`: for TAPE's stream 64 was the fastest of 32, 64 and 128 at bench
speed's small and large sizes (docs/speed/stream_backward.py)."""


def stream_attention_backward(grad_out, q, k, stream, logsumexp, delta, is_causal: bool, scale: float,
                              attn_mask: torch.Tensor | None = None, block: int | None = None):
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
            seen = _seen_keys(attn_mask[..., start:end, :] > float("-inf"))
        q_block, grad_block = q_g[:, :, start:end].flatten(1, 2), grad_g[:, :, start:end].flatten(1, 2)
        probs = torch.baddbmm(minus_lse[:, :, start:end].flatten(1, 2), q_block, k_rows[:, :seen].transpose(1, 2),
                              alpha=scale)
        if attn_mask is not None:  # (B or 1, 1 or H, n, seen) added over (B, Hkv, G, n, seen) by broadcasting
            rows_mask = attn_mask[..., start:end, :seen]
            rows_mask = (rows_mask.unflatten(1, (kv_heads, groups)) if rows_mask.shape[1] > 1
                         else rows_mask.unsqueeze(2))
            probs.view(batch, kv_heads, groups, end - start, seen).add_(rows_mask)
        probs.exp_()
        if is_causal:  # keys after each query, within the block's own span
            later = torch.ones(end - start, seen - start, dtype=torch.bool, device=q.device).triu(1)
            probs.view(rows, groups, end - start, seen)[..., start:].masked_fill_(later, 0.0)
        grad_stream[:, :seen].baddbmm_(probs.transpose(1, 2), grad_block)
        grad_logits = probs.mul_(torch.baddbmm(minus_delta[:, :, start:end].flatten(1, 2), grad_block,
                                               stream_rows[:, :seen].transpose(1, 2)))
        grad_q[:, :, start:end] = torch.bmm(grad_logits, k_rows[:, :seen]).view(rows, groups, end - start, -1)
        grad_k[:, :seen].baddbmm_(grad_logits.transpose(1, 2), q_block)
    return (grad_q.mul_(scale).view(q.shape), grad_k.mul_(scale).view(k.shape),
            grad_stream.view(stream.shape))


def _by_kv_head(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, N, ...) -> (B * Hkv, H / Hkv, N, ...): the query heads of each KV head together."""
    return x.unflatten(1, (kv_heads, -1)).flatten(0, 1)


def attend_with_probabilities(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
                              bias: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend` through the explicit path, also returning the attention probabilities (B, H, N, T)
    (`output_attentions=True`)."""
    return explicit_attention(q, k, v, _with_bias(mask, materialized(bias)), mask.is_causal, scale)


def _sdpa_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype SDPA computes in for these inputs: autocast's when it is on for their device (as SDPA itself is cast
    under autocast), else their common dtype."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    dtype = tensors[0].dtype
    for tensor in tensors[1:]:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def _with_bias(mask: AttentionMask, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The boolean mask, or the float mask that adds `bias` where keys are visible."""
    if bias is None:
        return mask.valid
    return torch.where(mask.valid, bias, float("-inf"))


def explicit_attention(q, k, v, mask, is_causal, scale):
    """The reference path, also used for single-token decoding, where it reads each cached key and value once and
    needs no padding: explicit logits, softmax in float32 or wider, GQA by grouping query heads (no copies of k, v).
    Returns the output (B, H, N, dv) and the probabilities (B, H, N, T), the very tensor the output is computed from
    (so a gradient reaches it, as in transformers' eager attention)."""
    batch, heads, length, _ = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    logits = q.reshape(batch, kv_heads, groups * length, -1) @ k.transpose(-1, -2)
    logits = logits.to(torch.promote_types(q.dtype, torch.float32)).view(batch, kv_heads, groups, length, keys) * scale
    if is_causal:
        mask = torch.ones(length, keys, dtype=torch.bool, device=q.device).tril(keys - length)
    if mask is not None:
        mask = mask.unflatten(1, (kv_heads, groups)) if mask.dim() == 4 and mask.shape[1] == heads else mask.unsqueeze(-3)
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    probs = logits.softmax(dim=-1).to(v.dtype).view(batch, heads, length, keys)
    return (probs.view(batch, kv_heads, groups * length, keys) @ v).view(batch, heads, length, -1), probs
