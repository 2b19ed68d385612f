"""Where the real tokens of a padded batch are, so that per-token work skips the padding.

Norms, projections and the MLP act on each token alone, so in a padded batch they can run on the real tokens only,
gathered into one (T, C) matrix; only attention (and the positional hooks, which see whole sequences) needs the
padded (B, N) grid. On short synthetic tasks padding is a quarter of a batch or more, and a step's time is close to
linear in the rows of its matrix multiplies. The function is unchanged for every real token: padding keys are masked
in attention, and padding positions (zeros on the grid) feed nothing a real token reads.
"""

from __future__ import annotations

import torch

from .masks import tracing


class TokenLayout:
    """Converts between the padded grid (B, N, ...) and the real tokens (T, ...) of one forward pass.

    Without padding (or for single-token steps) both directions return their input: per-token work then runs on
    the grid, as it would anyway. While tracing, per-token work runs on the whole grid and `unpack` zeroes the
    padding positions (`zeroed`, (B, N)), so that a traced program computes there what eager code does: the zeros
    the projections scatter to the grid, and so the same cache."""

    def __init__(self, batch: int, length: int, real: torch.Tensor | None = None, zeroed: torch.Tensor | None = None):
        self.batch, self.length = batch, length
        self.index = None if real is None else real.flatten().nonzero().squeeze(1)
        self.zeroed = zeroed

    @classmethod
    def of(cls, token_mask: torch.Tensor | None, batch: int, length: int) -> TokenLayout:
        """The layout of a pass whose new tokens are real where `token_mask` (B, N) is True (None: all real).
        While tracing (torch.export, torch.compile) nothing is skipped, the real tokens' count being data: padding
        positions are zeroed instead."""
        if token_mask is not None and length > 1 and tracing(token_mask):
            return cls(batch, length, zeroed=token_mask)
        packs = token_mask is not None and length > 1 and not bool(token_mask.all())
        return cls(batch, length, token_mask if packs else None)

    @property
    def packed(self) -> bool:
        return self.index is not None

    def pack(self, grid: torch.Tensor) -> torch.Tensor:
        """(B, N, ...) -> (T, ...): the real tokens in row-major order."""
        if self.index is None:
            return grid
        return grid.flatten(0, 1).index_select(0, self.index)

    def unpack(self, tokens: torch.Tensor) -> torch.Tensor:
        """(T, ...) -> (B, N, ...), zeros at padding."""
        if self.zeroed is not None:
            return tokens * self.zeroed.view(*self.zeroed.shape, *(1,) * (tokens.dim() - 2)).to(tokens.dtype)
        if self.index is None:
            return tokens
        grid = tokens.new_zeros(self.batch * self.length, *tokens.shape[1:])
        return grid.index_copy(0, self.index, tokens).unflatten(0, (self.batch, self.length))


__all__ = ["TokenLayout"]
