"""The attention mask of one forward pass: causality, padding (a 2D mask), packed documents, or a given 4D mask.

Packed documents follow transformers' rules (`masking_utils.find_packed_sequence_indices`): with no attention mask,
a causal model and nothing cached, a new document starts wherever `position_ids` do not go up by exactly 1 (what
`DataCollatorWithFlattening` and TRL's padding-free batches produce); `cu_seq_lens_q` (the collator's flash-attention
keyword arguments) states the documents directly. Each token then sees only the earlier tokens of its own document.
One difference to Llama: Llama looks for documents only when no cache object is passed at all (so not with its
default `use_cache=True`); tapelm looks whenever nothing is cached yet. Positions with gaps meant as one sequence need
an attention mask (all ones), as in transformers.

Decisions that read tensor values (is there padding? several documents?) only pick a faster equivalent path. While
torch.export, torch.compile or fx trace the model they are skipped and the dense mask is built, so a traced program
never branches on data; where the batch comes with its `tapelm.layout.HostLayout`, the host's answers are taken
instead of reading the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.utils.import_utils import is_tracing

from .kernels.attention import AttentionMask, Segments


def tracing(tensor: torch.Tensor | None = None) -> bool:
    """Whether torch.export / torch.compile / fx is tracing (then no Python branch may read tensor values)."""
    return is_tracing(tensor)


def packed_documents(
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    past: int,
    causal: bool,
    batch: int,
    length: int,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    host=None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The document index (B, N) of every new token when rows pack several documents (else None), and the positions
    that `cu_seq_lens_q` implies (None unless it is given without `position_ids`). `host`: the batch's
    `tapelm.layout.HostLayout`, which answers what would otherwise be read from the device (None: read it)."""
    if cu_seq_lens_q is not None:
        return _documents_from_cu_seq_lens(
            cu_seq_lens_q, cu_seq_lens_k, position_ids, attention_mask, past, batch, length, host
        )
    if position_ids is None or attention_mask is not None or past or not causal:
        return None, None
    position_ids = position_ids.expand(batch, -1)
    documents = (torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    if tracing(documents):
        return documents, None
    several = host.documents if host is not None else bool(documents[:, -1].any())
    return (documents, None) if several else (None, None)


def _documents_from_cu_seq_lens(cu_q, cu_k, position_ids, attention_mask, past, batch, length, host):
    known = tracing(cu_q) or host is not None  # no device value need be read
    if cu_k is not None and not (cu_k.shape == cu_q.shape and (known or torch.equal(cu_k, cu_q))):
        raise ValueError("cu_seq_lens_k must equal cu_seq_lens_q: packed documents attend only to themselves")
    if batch != 1 or attention_mask is not None or past:
        raise ValueError(
            "cu_seq_lens_q describes one packed row: pass batch size 1, no attention_mask and no cached tokens"
        )
    if host is not None and (host.cu_seq_lens is None or cu_q.shape != (len(host.cu_seq_lens),)):
        raise ValueError(
            f"host_layout's cu_seq_lens {host.cu_seq_lens} disagree with cu_seq_lens_q {tuple(cu_q.shape)}"
        )
    if cu_q.dim() != 1 or (not tracing(cu_q) and _ends(cu_q, host) != (0, length)):
        raise ValueError(
            f"cu_seq_lens_q must be the 1D cumulative document lengths from 0 to the row's {length} "
            f"tokens, got {cu_q.tolist() if not tracing(cu_q) else tuple(cu_q.shape)}"
        )
    index = torch.arange(length, device=cu_q.device)
    documents = torch.searchsorted(cu_q[1:].to(index.dtype), index, right=True)
    positions = None if position_ids is not None else (index - cu_q.to(index.dtype)[documents])[None]
    return documents[None], positions


def _ends(cu_q: torch.Tensor, host) -> tuple[int, int]:
    """The first and last of the cumulative lengths, from the host where it knows them."""
    bounds = host.cu_seq_lens if host is not None else cu_q
    return int(bounds[0]), int(bounds[-1])


def real_tokens(
    attention_mask: torch.Tensor | None, length: int, past, padded: bool | None = None
) -> torch.Tensor | None:
    """(B, N) True where a new token is real, False at padding; None when all are real (outside tracing). A 4D mask
    marks as padding the tokens that may not see themselves. `past` is the number of cached tokens (an int, or a
    device tensor for a fixed-shape cache); `padded`, whether some token is padding, when the host knows it (None:
    read from the mask)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 4:
        own = (torch.arange(length, device=attention_mask.device) + past)[None, :, None]  # each token's own key
        real = attention_mask[:, 0].gather(-1, own.expand(attention_mask.shape[0], length, 1))[..., 0]
        real = real if real.dtype == torch.bool else real == 0
    else:
        real = attention_mask[:, -length:].bool()
    if tracing(real):
        return real
    return real if (padded if padded is not None else not bool(real.all())) else None


def build_attention_mask(
    attention_mask: torch.Tensor | None,
    documents: torch.Tensor | None,
    query_len: int,
    key_len: int,
    causal: bool,
    dense: bool,
    device: torch.device,
    past=None,
    padded: bool | None = None,
    segments: Segments | None = None,
) -> AttentionMask:
    """The mask for N new queries over T keys, on `device` (the inputs'): the queries follow `past` cached tokens
    (default: they are the last N of the T keys; a fixed-shape cache has T larger than past + N, and keys from
    past + N on are not written yet). `attention_mask` is a 2D padding mask (B, past + N), 1 for real tokens, or a 4D
    mask (B or 1, 1, N, T) as transformers takes it (see `given_mask`); `documents` (B, N) from `packed_documents`.

    `dense` asks for explicit booleans even where a flag would do (encodings that add a logit bias). A query that
    would see no key at all (a padding token) is allowed to see itself, so no softmax row is empty.

    `padded` (whether the 2D mask holds a 0) and `segments` (how the mask cuts the batch into causal sequences) are
    what the batch maker knew on the host (`tapelm.layout.HostLayout`); None: read from the masks when needed."""
    past = key_len - query_len if past is None else past
    if attention_mask is not None and attention_mask.dim() == 4:
        return AttentionMask(given_mask(attention_mask, query_len, key_len, causal, past), False)
    padding = attention_mask
    if padding is None or tracing(padding):
        has_padding = padding is not None
    else:
        has_padding = padded if padded is not None else not bool(padding.all())
    if not dense and not has_padding and documents is None:
        if not causal or query_len == 1:
            return AttentionMask(None, False, segments)
        if query_len == key_len:
            return AttentionMask(None, True, segments)
    key_index = torch.arange(key_len, device=device)
    query_index = torch.arange(query_len, device=device) + past
    valid = torch.ones(1, 1, query_len, key_len, dtype=torch.bool, device=device)
    if causal:
        valid = valid & (key_index[None, :] <= query_index[:, None])
    else:  # keys not written yet (a fixed-shape cache)
        valid = valid & (key_index[None, :] < query_index[-1] + 1)
    if padding is not None:
        padding = F.pad(padding.bool(), (0, key_len - padding.shape[-1]))  # unwritten keys of a fixed-shape cache
        valid = valid & padding[:, None, None, :]
    if documents is not None:
        valid = valid & (documents[:, None, :, None] == documents[:, None, None, :])
    valid = valid | (key_index[None, :] == query_index[:, None])
    return AttentionMask(valid, False, segments)


def given_mask(mask: torch.Tensor, query_len: int, key_len: int, causal: bool, past=None) -> torch.Tensor:
    """A 4D attention mask (B or 1, 1, N, T) as transformers models take it, as booleans: True (bool) or 0 (float)
    where a query may see a key, False or -inf / the dtype's minimum where not. It is the whole mask (causality and
    padding included); a causal model refuses one that shows a query a later key. A query that may see no key at all
    sees itself (no empty softmax row). The queries follow `past` cached tokens (default: T - N)."""
    past = key_len - query_len if past is None else past
    if mask.shape[1] != 1 or tuple(mask.shape[2:]) != (query_len, key_len):
        raise ValueError(
            f"a 4D attention_mask must have shape (batch, 1, {query_len}, {key_len}) for {query_len} new "
            f"tokens over {key_len} keys (cached and new), got {tuple(mask.shape)}"
        )
    if mask.dtype == torch.bool:
        valid = mask
    elif mask.is_floating_point():
        valid = mask > torch.finfo(mask.dtype).min
        if not tracing(mask) and not bool(((mask == 0) | ~valid).all()):
            raise ValueError(
                "a float 4D attention_mask may hold only 0 (attend) and -inf or the dtype's minimum "
                "(masked); pass other logit biases some other way"
            )
    else:
        raise ValueError(f"a 4D attention_mask must be bool (True: attend) or float (0 / -inf), not {mask.dtype}")
    key_index = torch.arange(key_len, device=mask.device)
    query_index = torch.arange(query_len, device=mask.device) + past
    later = key_index[None, :] > query_index[:, None]
    if causal:
        if not tracing(mask) and bool((valid & later).any()):
            raise ValueError(
                "this model is causal (config.causal=True): a 4D attention_mask may not let a query see a later key"
            )
        valid = valid & ~later
    return valid | ((key_index[None, :] == query_index[:, None]) & ~valid.any(-1, keepdim=True))


__all__ = ["build_attention_mask", "packed_documents", "real_tokens", "tracing"]
