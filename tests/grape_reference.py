"""The attention logits of the GRAPE authors' released models, restated plainly for the tests (not their code, which
is neither a package nor reachable in CI): model-architectures/GRAPE, model/llama-mha-grape-m-nonctx.py,
llama-mha-grape-m-ctx.py, llama-mha-grape-ap-v1.py and llama-mha-grape-a-querygated.py, -keygated.py and
-querykeygated.py, with their defaults, multi-head attention (one KV head per query head) and without their optional
extras (QK RMSNorm, KV shift), which are not positional.

Every function takes the attention input x (B, T, C) after the block's norm and the weights in the authors' layout
(nn.Linear's (out, in)), and returns the pre-softmax logits (B, H, T, T), -inf above the diagonal. Their rotation
turns each pair (x1, x2) = (x[:d/2], x[d/2:]) to (x1 cos + x2 sin, x2 cos - x1 sin): by minus the angle, against
RoPE's (and tapelm's) direction.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def released_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The authors' planar rotation of x (B, T, H, D) by tables broadcastable to (B, T, H, D/2)."""
    first, second = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat([first * cos + second * sin, second * cos - first * sin], dim=-1)


def heads(x: torch.Tensor, weight: torch.Tensor, count: int) -> torch.Tensor:
    """x @ weight^T as (B, T, heads, width)."""
    batch, length, _ = x.shape
    return (x @ weight.T).view(batch, length, count, -1)


def causal_logits(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """q k^T / sqrt(D) (+ bias) for q, k (B, T, H, D), with -inf above the diagonal (SDPA's causal mask)."""
    length = q.shape[1]
    logits = q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + bias
    later = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    return logits.masked_fill(later, float("-inf"))


def rope_frequencies(head_dim: int, base: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """1 / base^(2j / D), j < D/2, as the authors initialise their spectrum (computed in float32)."""
    return (1.0 / (base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))).to(dtype)


def per_head(freq: torch.Tensor, count: int) -> torch.Tensor:
    """A spectrum shared by all heads (D/2,) or one per head (H, D/2), as (H, D/2)."""
    return freq.expand(count, -1) if freq.dim() == 1 else freq


def grape_m_fixed(x, wq, wk, log_freq, count: int, log_freq_scale: float = 16.0) -> torch.Tensor:
    """Non-contextual GRAPE-M: frequencies exp(log_freq / scale); angle t * freq at position t = 0, 1, ..."""
    q, k = heads(x, wq, count), heads(x, wk, count)
    freq = per_head(torch.exp(log_freq / log_freq_scale), count)
    angles = torch.arange(x.shape[1], dtype=x.dtype, device=x.device)[:, None, None] * freq[None]  # (T, H, D/2)
    cos, sin = angles.cos()[None], angles.sin()[None]
    return causal_logits(released_rotation(q, cos, sin), released_rotation(k, cos, sin))


def grape_m_contextual(x, wq, wk, w_omega, b_omega, log_freq, count: int, omega_scale: float = 16.0):
    """Contextual GRAPE-M (Type-I): omega = sigmoid((x w^T + b) / scale) per token (or head), the exclusive running
    sum Phi_t = cumsum - omega, angle Phi_t * exp(log_freq)."""
    q, k = heads(x, wq, count), heads(x, wk, count)
    omega = torch.sigmoid((x @ w_omega.T + b_omega) / omega_scale)  # (B, T, 1 or H)
    phi = (torch.cumsum(omega, dim=1) - omega).expand(-1, -1, count)
    angles = phi[..., None] * per_head(torch.exp(log_freq), count)[None, None]  # (B, T, H, D/2)
    cos, sin = angles.cos(), angles.sin()
    return causal_logits(released_rotation(q, cos, sin), released_rotation(k, cos, sin))


def alibi_slopes(count: int) -> list[float]:
    """ALiBi's head slopes, the rule the authors use (a power of 2, else the nearest lower power's slopes followed by
    every other slope of twice that many)."""

    def powers(n):
        first = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [first * first**i for i in range(n)]

    if math.log2(count).is_integer():
        return powers(count)
    lower = 2 ** math.floor(math.log2(count))
    return powers(lower) + alibi_slopes(2 * lower)[0::2][: count - lower]


def grape_ap(x, wq, wk, wv, wp, count: int, tie: str = "none", p_width: int = 8) -> torch.Tensor:
    """GRAPE-AP (v1): p per head from its own projection or tied to q, k or v; n = rms_norm(p) rotated by RoPE at
    base 1 to position l; bias(i, j) = slope_h * sum_{j < l <= i} logsigmoid(p_i . rot(n_l) / d_p)."""
    q, k, v = heads(x, wq, count), heads(x, wk, count), heads(x, wv, count)
    p = {"none": heads(x, wp, count) if wp is not None else None, "q": q, "k": k, "v": v}[tie]
    width, length = p.shape[-1], x.shape[1]
    normed = F.rms_norm(p, (width,))
    angles = torch.outer(
        torch.arange(length, dtype=x.dtype, device=x.device), rope_frequencies(width, 1.0, x.dtype, x.device)
    )
    rotated = released_rotation(normed, angles.cos()[None, :, None], angles.sin()[None, :, None])
    terms = F.logsigmoid(p.transpose(1, 2) @ rotated.transpose(1, 2).transpose(-1, -2) / width)
    terms = terms * torch.tensor(alibi_slopes(count), dtype=x.dtype, device=x.device).view(1, count, 1, 1)
    seen = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    terms = terms.masked_fill(~seen, 0.0)
    bias = terms.sum(-1, keepdim=True) - terms.cumsum(-1)
    return causal_logits(q, k, bias)


def grape_a(x, wq, wk, omega, v, u, count: int, l2_norm: bool = True) -> torch.Tensor:
    """GRAPE-A, query-gated (v given), key-gated (u given) or both: rate_h = slope_h * softplus(omega_h); gates
    softplus(v_h . q_i / sqrt(D)) and softplus(u_h . k_j / sqrt(D)) with v, u L2-normalised (eps 1e-6);
    bias(i, j) = -max(i - j, 0) * rate_h * (the query's gate + the key's gate)."""
    q, k = heads(x, wq, count), heads(x, wk, count)
    width, length = q.shape[-1], x.shape[1]

    def gate(t, direction):  # (B, T, H, D), (H, D) -> (B, H, T)
        if l2_norm:
            direction = F.normalize(direction, p=2, dim=-1, eps=1e-6)
        return F.softplus((t * direction).sum(-1) / math.sqrt(width)).transpose(1, 2)

    rate = F.softplus(omega) * torch.tensor(alibi_slopes(count), dtype=x.dtype, device=x.device)
    positions = torch.arange(length, device=x.device)
    distance = (positions[:, None] - positions[None]).clamp_min(0).to(x.dtype)
    total = 0
    if v is not None:
        total = total + gate(q, v)[..., :, None]
    if u is not None:
        total = total + gate(k, u)[..., None, :]
    return causal_logits(q, k, -distance * rate.view(1, count, 1, 1) * total)
