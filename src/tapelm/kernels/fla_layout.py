"""What fla's attention kernels need from tapelm's calls: the batch cut into variable-length causal sequences (fla's
`cu_seqlens`) from tapelm's mask (or from the batch's host layout, without reading the mask), and fla's token-major
layout. fla 0.6's kernels themselves read `cu_seqlens` back to the host (`fla.ops.utils.prepare_chunk_indices`), so a
segmented call (padding, packed documents) still waits for the device once inside fla; they take no host copy."""

from __future__ import annotations

import torch

from .attention import AttentionMask


def segments(mask: AttentionMask, batch: int, queries: int, keys: int) -> torch.Tensor | None | bool:
    """How the mask cuts the batch into causal sequences: None when every row is one causal sequence; the cumulative
    lengths (int64) of the segments over the B x N tokens laid out as one row, when each token sees exactly the
    earlier tokens of its own contiguous segment; False for any other mask, or when keys are cached (more keys than
    queries, in the call or in the mask). The mask's host-known `segments`, where given, answer without reading it."""
    if keys != queries or (mask.valid is not None and mask.valid.shape[-1] != queries):
        return False
    if mask.segments is not None:
        return mask.segments.cuts
    if mask.valid is None:
        return None if mask.is_causal else False
    valid = mask.valid[:, 0].expand(batch, queries, keys)
    index = torch.arange(queries, device=valid.device)
    first = valid.int().argmax(-1)  # the first key each query sees (B, N)
    causal_run = (index[None, None, :] >= first[..., None]) & (index[None, None, :] <= index[None, :, None])
    starts = first == index
    follows = torch.cat([starts[:, :1], first[:, 1:] == first[:, :-1]], dim=1)  # same segment as the token before
    if not bool(torch.equal(valid, causal_run) and (starts | follows).all()):
        return False
    if bool(starts.sum() == batch):
        return None
    every = starts.flatten().nonzero()[:, 0]
    return torch.cat([every, every.new_tensor([batch * queries])])


def shortest(mask: AttentionMask, cuts: torch.Tensor | None, queries: int) -> int:
    """The length of the shortest of `segments`' sequences (`cuts`), from the host where it knew them."""
    if cuts is None:
        return queries
    return mask.segments.shortest if mask.segments is not None else int((cuts[1:] - cuts[:-1]).min())


def heads_last(x: torch.Tensor, segmented: bool) -> torch.Tensor:
    """(B, H, N, ...) to fla's (B, N, H, ...), contiguous (the kernels index it so), one row of B x N tokens when the
    batch runs as segments."""
    x = x.transpose(1, 2).contiguous()
    return x.reshape(1, -1, *x.shape[2:]) if segmented else x


def heads_first(out: torch.Tensor, batch: int) -> torch.Tensor:
    return out.reshape(batch, -1, *out.shape[2:]).transpose(1, 2)


__all__ = ["heads_first", "heads_last", "segments", "shortest"]
