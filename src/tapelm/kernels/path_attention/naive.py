"""PaTH's attention logits in plain PyTorch, the reference: q_i^T H_i H_{i-1} ... H_{j+1} k_j with H_s =
I - beta_s w_s w_s^T (tapelm.positional.path has the encoding).

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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


class PathLogits:
    """PaTH's raw dot products q_i^T H_i ... H_{j+1} k_j for N new tokens after T_past cached ones, a block of queries
    at a time.

    q (B, Hkv, G, N, d): queries grouped by KV head; k, w (B, Hkv, N, d); beta (B, Hkv, N); past_keys
    (B, Hkv, T_past, d): the cached keys, already transformed up to the last cached token; `chunk` tokens per chunk
    (default `CHUNK`). What every block needs is computed here, once: per chunk its transform (d x d), its keys
    carried to its end, its queries carried back to its start and its own logits."""

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        w: torch.Tensor,
        beta: torch.Tensor,
        past_keys: torch.Tensor | None = None,
        chunk: int | None = None,
    ):
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
            lower,
            torch.cat([weighted, (weighted @ k.transpose(-1, -2)) * strict], dim=-1),
            upper=False,
            unitriangular=True,
        )
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
            logits = torch.cat(
                [earlier.unflatten(-2, (self.groups, size)).transpose(2, 3).flatten(3, 4), logits], dim=-1
            )
        return logits[..., start - first * size : end - first * size, :]

    def carried_keys(self) -> torch.Tensor:
        """Every key transformed up to the last new token (B, Hkv, T_past + N, d): the cache's next content."""
        keys = self.past if self.past is not None else self.keys.new_zeros(*self.keys.shape[:2], 0, self.keys.shape[-1])
        for chunk in range(self.chunks):
            keys = torch.cat(
                [keys - keys @ self.transform[:, :, chunk].transpose(-1, -2), self.keys[:, :, chunk]], dim=-2
            )
        return keys[..., : keys.shape[-2] - (self.chunks * self.size - self.length), :]


def path_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    past_keys: torch.Tensor | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All of `PathLogits` at once: the dot products (B, Hkv, G, N, T_past + N) and the carried keys."""
    logits = PathLogits(q, k, w, beta, past_keys, chunk)
    return logits.rows(0, q.shape[-2]), logits.carried_keys()


__all__ = ["CHUNK", "PathLogits", "path_logits"]
