"""4D attention masks as transformers models take them: the same function as the 2D padding mask they spell out,
and clear refusals of what they cannot mean."""

import pytest
import torch
from transformers.cache_utils import DynamicCache

from conftest import DEVICE, tiny_model, tokens

pytestmark = pytest.mark.device


def padded_batch():
    ids = tokens(3, 9, seed=2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :7] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def spelled_out(mask: torch.Tensor, query_len: int, masked_value=None) -> torch.Tensor:
    """The 4D mask (B, 1, N, T) of a 2D padding mask, causal, for the last N of T tokens: booleans, or floats with 0
    and `masked_value`."""
    keys = mask.shape[1]
    causal = torch.ones(query_len, keys, dtype=torch.bool, device=DEVICE).tril(keys - query_len)
    full = causal[None, None] & mask[:, None, None, :].bool()
    if masked_value is None:
        return full
    return torch.zeros(full.shape, dtype=torch.float64, device=DEVICE).masked_fill(~full, masked_value)


@pytest.mark.parametrize("masked_value", [None, float("-inf"), torch.finfo(torch.float64).min])
def test_a_4d_mask_is_its_2d_padding_mask(pe_type, masked_value):
    """Bool, or float with -inf or the dtype's minimum (transformers' eager masks) where keys are hidden."""
    model = tiny_model(pe_type, dtype=torch.float64)
    ids, mask, positions = padded_batch()
    four = spelled_out(mask, ids.shape[1], masked_value)
    expected = model(ids, attention_mask=mask, position_ids=positions).logits
    got = model(ids, attention_mask=four, position_ids=positions).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-10, rtol=0)


@pytest.mark.parametrize("pe_type", ["tape", "alibi", "fox", "path", "stickbreaking"])
def test_a_4d_mask_continues_a_cache(pe_type):
    model = tiny_model(pe_type, dtype=torch.float64)
    ids, mask, positions = padded_batch()
    full = model(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    cache = DynamicCache(config=model.config)
    first = model(ids[:, :5], attention_mask=spelled_out(mask[:, :5], 5), position_ids=positions[:, :5], cache=cache)
    rest = model(ids[:, 5:], attention_mask=spelled_out(mask, 4), position_ids=positions[:, 5:], cache=first.cache)
    real = mask.bool()
    torch.testing.assert_close(torch.cat([first.logits, rest.logits], dim=1)[real], full[real], atol=1e-10, rtol=0)


def test_a_block_diagonal_4d_mask_packs_documents(pe_type):
    """A packed row given as its 4D mask computes each document alone (PaTH's convolution included)."""
    model = tiny_model(pe_type, dtype=torch.float64)
    docs = [tokens(1, 4, seed=0), tokens(1, 5, seed=1)]
    ids = torch.cat(docs, dim=1)
    positions = torch.cat([torch.arange(4, device=DEVICE), torch.arange(5, device=DEVICE)])[None]
    same = torch.block_diag(torch.ones(4, 4, device=DEVICE), torch.ones(5, 5, device=DEVICE)).bool().tril()
    logits = model(ids, attention_mask=same[None, None], position_ids=positions).logits
    torch.testing.assert_close(logits, torch.cat([model(doc).logits for doc in docs], dim=1), atol=1e-10, rtol=0)


def test_4d_masks_that_mean_something_else_are_refused():
    model = tiny_model("rope")
    ids = tokens(1, 5)
    ones = torch.ones(1, 1, 5, 5, dtype=torch.bool, device=DEVICE)
    for mask, message in (
        (ones[:, :, :4], "must have shape"),
        (ones.long(), "must be bool"),
        (ones.float() * 0.5, "only 0"),
        (ones, "later key"),
    ):
        with pytest.raises(ValueError, match=message):
            model(ids, attention_mask=mask)
    bidirectional = tiny_model("rope", causal=False)
    bidirectional(ids, attention_mask=ones)  # an encoder may see later keys
