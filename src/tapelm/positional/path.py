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

from ..cache import cached_keys, rewrite_keys, store_keys_values
from ..kernels.path_attention import PathLogits, path_attention_bias
from .base import LayerPositional, PerLayerEncoding, check_positive
from .convolution import short_convolution
from .costs import measured

NORM_EPS = 1e-6


class PaTHLayer(LayerPositional):
    """One layer's Householder vectors (low-rank projection, short convolution, SiLU, L2 norm) and strengths."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        kv_dim = self.kv_heads * self.head_dim
        rank = config.path_low_rank
        if rank:
            self.w_proj = nn.Sequential(
                nn.Linear(config.hidden_size, rank, bias=False), nn.Linear(rank, kv_dim, bias=False)
            )
        else:
            self.w_proj = nn.Linear(config.hidden_size, kv_dim, bias=False)
        self.w_conv = nn.Conv1d(kv_dim, kv_dim, config.path_conv_size, groups=kv_dim, bias=False)
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
        mixed = short_convolution(inputs, self.w_conv.weight, cache, self.layer_idx, valid)
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
        bias = path_attention_bias(logits, q, raw_keys, w, beta, self.logit_scale(dim))
        if cache is not None:
            k, stream = store_keys_values(cache, layer_idx, k, stream, value_width)
            rewrite_keys(cache, layer_idx, logits.carried_keys().to(k.dtype))
        return torch.zeros_like(q), k, stream, bias


class PaTH(PerLayerEncoding):
    """Model level: nothing but the per-layer transforms; the logits arrive as an explicit float bias. Its cached keys
    are read as a sequence (each is transformed by every later token's Householder), so a static cache hands it only
    the written rows."""

    reads_position_limit = False
    display_name = "PaTH"
    family = "accumulating"
    step_cost = measured(7.05)

    adds_logit_bias = True
    fixed_shape_cache = False
    causal_only = True
    layer_class = PaTHLayer

    @classmethod
    def validate_fields(cls, config) -> None:
        rank = config.path_low_rank
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(
                f"path_low_rank={rank!r} is not allowed; it must be an integer >= 0 (0: a full-rank projection)"
            )
        check_positive("path_conv_size", config.path_conv_size)
