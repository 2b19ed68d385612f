"""PaTH (Yang, Shen, Wen, Tan, Mishra, Ren, Panda, Kim 2025, "PaTH Attention: Position Encoding via Accumulating
Householder Transformations"): contextual positions as a product of data-dependent Householder-like transforms.

Every token s brings H_s = I - beta_s w_s w_s^T, per key/value head. Query i sees key j through the transforms of the
tokens after j up to and including i:

    logit(i, j) = q_i^T H_i H_{i-1} ... H_{j+1} k_j / sqrt(d)          (H_i applied last; i = j: plain q_i . k_j)

Conventions read from the reference, fla (fla-org/flash-linear-attention: fla/layers/path_attn.py and
fla/ops/path_attn/naive.py), not copied:

- w_s: the layer's attention input x_s (after the norm) through a low-rank projection hidden -> 32 -> kv_dim
  (`path_low_rank`, fla's `use_low_rank_w`; 0 gives one full-rank projection), a depthwise causal convolution of
  kernel 3 without bias (`path_conv_size`, fla's `ShortConvolution`) and SiLU, then L2-normalised per head.
- beta_s = 2 sigmoid(linear(x_s)) in (0, 2) per key/value head (with bias): negative eigenvalues allowed; beta = 2 is
  an exact reflection (orthogonal), beta = 0 the identity.
- The transform acts on keys; with cached decoding the cached keys are multiplied by the new token's H (fla's
  `rank_one_update`), so the cache always holds k_j transformed up to the last token. Query heads of one KV group
  share w and beta. No RoPE.
- fla normalises w with x / sqrt(|x|^2 + 1e-6); tapelm divides by max(|x|, 1e-6), so w is exactly a unit vector
  (H exactly a reflection at beta = 2) unless it is (nearly) zero, e.g. at padding tokens, where H = I.

Computation: exact, chunkwise (chunks of 64 tokens), as fla's naive reference walks it. Within a chunk the product of
its Householders has the "UT" form P = I - W^T T B W with T = (I + B strictly_lower(W W^T))^{-1} (B = diag(beta)),
and the product over any contiguous sub-range is the same expression with T's matching diagonal block, so one
triangular solve per chunk gives: the logits within the chunk; every key carried to its chunk's end; every query
carried back to its chunk's start; and the chunk's whole transform as one d x d matrix. A query then meets the keys of
earlier chunks by walking back over them, taking the logits with each chunk's keys and applying that chunk's
transform to itself. The walk needs nothing but the query's own rows, so the logits come a block of queries at a time
(`PathLogits.rows`, an `attention.RowBias`): attention builds them per block inside an activation checkpoint and never
keeps the N x T logits for the backward pass. O(N^2 d + N d^2) time. tests/test_peers.py checks this against the
explicit product of Householder matrices for every pair, in float64.

PaTH's logits are not q . k for one fixed key per token, so the layer hands them to attention as the additive bias and
gives attention a zero query: softmax, masking and the value mixing stay the decoder's. The cache holds the transformed
keys (rewritten in place at every step), the values, and beside them the convolution's inputs (kv_dim
numbers per token). A cropped cache cannot be un-transformed: `crop` (assisted / contrastive decoding) is not
supported for PaTH.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import RowBias
from ..cache import cached_keys, cached_state, rewrite_keys, store_keys_values, store_state
from ..kernels import fla
from .base import LayerPositional, PositionalEncoding

CHUNK = 64
NORM_EPS = 1e-6


class PathLogits:
    """PaTH's raw dot products q_i^T H_i ... H_{j+1} k_j for N new tokens after T_past cached ones, a block of queries
    at a time.

    q (B, Hkv, G, N, d): queries grouped by KV head; k, w (B, Hkv, N, d); beta (B, Hkv, N); past_keys
    (B, Hkv, T_past, d): the cached keys, already transformed up to the last cached token; `chunk` tokens per chunk
    (default `CHUNK`). What every block needs is computed here, once: per chunk its transform (d x d), its keys
    carried to its end, its queries carried back to its start and its own logits."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, beta: torch.Tensor,
                 past_keys: torch.Tensor | None = None, chunk: int | None = None):
        batch, kv_heads, groups, length, dim = q.shape
        size = min(chunk or CHUNK, length)
        chunks = -(-length // size)
        pad = chunks * size - length  # padding tokens: zero keys and queries, H = I
        q, k, w = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, w))
        beta = F.pad(beta, (0, pad))
        q = q.view(batch, kv_heads, groups, chunks, size, dim)
        k, w = (x.view(batch, kv_heads, chunks, size, dim) for x in (k, w))
        weighted = w * beta.view(batch, kv_heads, chunks, size, 1)  # rows beta_s w_s
        strict = torch.ones(size, size, dtype=torch.bool, device=q.device).tril(-1)  # token s after token j
        lower = torch.eye(size, dtype=q.dtype, device=q.device) + (weighted @ w.transpose(-1, -2)) * strict
        # T (B W) and T G with G[s, j] = beta_s w_s . k_j where token s comes after key j
        solved = torch.linalg.solve_triangular(
            lower, torch.cat([weighted, (weighted @ k.transpose(-1, -2)) * strict], dim=-1), upper=False,
            unitriangular=True)
        t_weighted, t_keys = solved.split([dim, size], dim=-1)
        seen = (q @ w[:, :, None].transpose(-1, -2)) * ~strict.T  # q_i . w_s for the chunk's tokens s <= i
        self.local = ((q @ k[:, :, None].transpose(-1, -2)) * ~strict.T - seen @ t_keys[:, :, None]) * ~strict.T
        # q_i^T H_i ... H_start, the group's query heads side by side: (B, Hkv, chunks, G x size, d)
        self.queries = (q - seen @ t_weighted[:, :, None]).transpose(2, 3).flatten(3, 4)
        self.keys = k - t_keys.transpose(-1, -2) @ w  # H_end ... H_{j+1} k_j
        self.transform = w.transpose(-1, -2) @ t_weighted  # the chunk's product, P = I - transform
        self.past = past_keys
        self.length, self.size, self.chunks, self.groups = length, size, chunks, groups

    def rows(self, start: int, end: int, keys: int | None = None) -> torch.Tensor:
        """The dot products of queries start..end-1 with the first `keys` keys (every key: None), cached ones first
        (B, Hkv, G, end - start, keys), zero where the key comes after the query."""
        size = self.size
        past = 0 if self.past is None else self.past.shape[-2]
        width = self.length if keys is None else max(min(self.length, keys - past), 0)  # new tokens' columns
        first, last = start // size, -(-end // size)
        own = torch.arange(first, last, device=self.queries.device)
        x = self.queries[:, :, first:last]  # (B, Hkv, n, G x size, d)
        pieces = []
        for step in range(1, last):  # every query chunk meets key chunk own - step, then applies its transform
            chunk = (own - step).clamp(min=0)
            pieces.append((x @ self.keys[:, :, chunk].transpose(-1, -2)).unflatten(-2, (self.groups, size)))
            transform = self.transform[:, :, chunk] * (own >= step).to(x.dtype)[:, None, None]
            x = x - x @ transform
        columns = max(-(-width // size), 1) * size
        rows = []
        for index, chunk in enumerate(range(first, last)):  # key chunk c < chunk met at step chunk - c
            blocks = [piece[:, :, index] for piece in reversed(pieces[:chunk])]
            blocks.append(self.local[..., chunk, :, :])
            filled = (chunk + 1) * size
            if filled < columns:
                blocks.append(x.new_zeros(*x.shape[:2], self.groups, size, columns - filled))
            rows.append(torch.cat(blocks, dim=-1)[..., :columns])
        logits = torch.cat(rows, dim=-2)[..., :width]
        if self.past is not None:
            earlier = x @ self.past[:, :, None, :keys].transpose(-1, -2)  # (B, Hkv, n, G x size, T_past)
            logits = torch.cat([earlier.unflatten(-2, (self.groups, size)).transpose(2, 3).flatten(3, 4), logits],
                               dim=-1)
        return logits[..., start - first * size: end - first * size, :]

    def carried_keys(self) -> torch.Tensor:
        """Every key transformed up to the last new token (B, Hkv, T_past + N, d): the cache's next content."""
        keys = self.past if self.past is not None else self.keys.new_zeros(*self.keys.shape[:2], 0,
                                                                           self.keys.shape[-1])
        for chunk in range(self.chunks):
            keys = torch.cat([keys - keys @ self.transform[:, :, chunk].transpose(-1, -2), self.keys[:, :, chunk]],
                             dim=-2)
        return keys[..., : keys.shape[-2] - (self.chunks * self.size - self.length), :]


def path_logits(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, beta: torch.Tensor,
                past_keys: torch.Tensor | None = None, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """All of `PathLogits` at once: the dot products (B, Hkv, G, N, T_past + N) and the carried keys."""
    logits = PathLogits(q, k, w, beta, past_keys, chunk)
    return logits.rows(0, q.shape[-2]), logits.carried_keys()


def _diagonal(valid: torch.Tensor, offset: int) -> torch.Tensor:
    """valid[b, s, s + offset] for every query s (B, N); False where that key would lie before the first one."""
    seen = valid.diagonal(offset=offset, dim1=-2, dim2=-1)
    return F.pad(seen, (valid.shape[-2] - seen.shape[-1], 0), value=False)


class PaTH(PositionalEncoding):
    """Model level: nothing but the per-layer transforms; the logits arrive as an explicit float bias. Its cached keys
    are read as a sequence (each is transformed by every later token's Householder), so a static cache hands it only
    the written rows."""

    adds_logit_bias = True
    fixed_shape_cache = False

    def __init__(self, config):
        super().__init__()
        self.config = config

    def make_layer(self, layer_idx: int) -> LayerPositional:
        return PaTHLayer(self.config, layer_idx)


class PaTHLayer(LayerPositional):
    """One layer's Householder vectors (low-rank projection, short convolution, SiLU, L2 norm) and strengths."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        kv_dim = self.kv_heads * self.head_dim
        rank = config.path_low_rank
        if rank:
            self.w_proj = nn.Sequential(nn.Linear(config.hidden_size, rank, bias=False),
                                        nn.Linear(rank, kv_dim, bias=False))
        else:
            self.w_proj = nn.Linear(config.hidden_size, kv_dim, bias=False)
        self.conv_size = config.path_conv_size
        self.w_conv = nn.Conv1d(kv_dim, kv_dim, self.conv_size, groups=kv_dim, bias=False)
        self.beta_proj = nn.Linear(config.hidden_size, self.kv_heads, bias=True)
        self.layer_idx = layer_idx

    def householder(self, x, ctx, cache, valid=None) -> tuple[torch.Tensor, torch.Tensor]:
        """w (B, Hkv, N, d), unit vectors, and beta (B, Hkv, N) in float32 or wider, for the new tokens. The
        convolution reads the inputs of the previous tokens from the cache and stores the new ones; token s reads
        token s - o's input only where the mask `valid` (B or 1, 1, N, T) lets it see that key, so padding and
        other packed documents bring it no history (None: every earlier token does)."""
        wide = torch.promote_types(x.dtype, torch.float32)
        batch, length, _ = x.shape
        inputs = self.w_proj(x)  # (B, N, kv_dim)
        beta = 2 * torch.sigmoid(self.beta_proj(x).to(wide))  # (B, N, Hkv)
        if ctx.token_mask is not None:  # padding: H = I
            beta = beta * ctx.token_mask[..., None]
        history = self.conv_size - 1
        mixed = inputs * self.w_conv.weight[:, 0, history]
        if history:
            past = cached_state(cache, self.layer_idx, "conv")
            store_state(cache, self.layer_idx, "conv", inputs[:, None])
            cached = 0 if past is None else past.shape[-2]
            before = inputs.new_zeros(batch, history, inputs.shape[-1])
            if past is not None:
                kept = min(history, cached)
                before[:, history - kept:] = past[:, 0, cached - kept:].to(inputs.dtype)
            sequence = torch.cat([before, inputs], dim=1)
            for offset in range(1, history + 1):
                earlier = sequence[:, history - offset: history - offset + length]  # token s - offset
                if valid is not None:
                    earlier = earlier * _diagonal(valid[:, 0], cached - offset)[..., None].to(inputs.dtype)
                mixed = mixed + earlier * self.w_conv.weight[:, 0, history - offset]
        w = F.silu(mixed).to(wide).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        w = w / w.norm(dim=-1, keepdim=True).clamp(min=NORM_EPS)
        return w, beta.transpose(1, 2)

    def attention_inputs(self, x, q, k, stream, value_width, cache, layer_idx, valid, ctx):
        w, beta = self.householder(x, ctx, cache, valid)
        wide = w.dtype
        batch, heads, length, dim = q.shape
        grouped = q.to(wide).view(batch, self.kv_heads, heads // self.kv_heads, length, dim)
        raw_keys = k
        past = cached_keys(cache, layer_idx)  # a copy: the cache is rewritten before attention reads the logits
        # built here, not on attention's first call: that call may lie inside an activation checkpoint
        logits = PathLogits(grouped, raw_keys.to(wide), w, beta, None if past is None else past.to(wide, copy=True))
        scale = self.logit_scale(dim)

        def kernel(_zero_queries, _cached_keys, v, mask, _scale):
            """fla's PaTH attention reads the raw queries and keys."""
            ops = fla.operations(q)
            return None if ops is None else fla.path_attention(ops, q, raw_keys, v, w, beta, mask, scale)

        if cache is not None:
            k, stream = store_keys_values(cache, layer_idx, k, stream, value_width)
            rewrite_keys(cache, layer_idx, logits.carried_keys().to(k.dtype))
        bias = RowBias(lambda start, end, keys: (logits.rows(start, end, keys) * scale).flatten(1, 2).to(q.dtype),
                       length, kernel)
        return torch.zeros_like(q), k, stream, bias
