"""Packed rows (several documents in one row, positions restarting at each): every document computes exactly what it
computes alone, for every encoding (forward and backward: `tapelm.testing.law_packed_documents`), also in batches of
rows and as transformers' padding-free collator feeds them."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DataCollatorWithFlattening
from transformers.masking_utils import find_packed_sequence_indices

from conftest import DEVICE, tiny_model, tokens
from tapelm.masks import packed_documents
from tapelm.positional.rotary import RandPE

pytestmark = pytest.mark.device

LENGTHS = (5, 3, 7)


def documents(lengths=LENGTHS, seed=0):
    return [tokens(1, n, seed=seed + i) for i, n in enumerate(lengths)]


def packed(docs):
    return torch.cat(docs, dim=1), torch.cat([torch.arange(d.shape[1], device=DEVICE) for d in docs])[None]


@pytest.mark.parametrize("pe_type", ["tape", "alibi", "cope", "path"])
def test_rows_packing_different_documents_in_one_batch(pe_type):
    model = tiny_model(pe_type, dtype=torch.float64)
    rows = [documents((4, 6), seed=0), documents((2, 5, 3), seed=5)]
    ids, positions = (torch.cat(parts) for parts in zip(*(packed(row) for row in rows)))
    logits = model(ids, position_ids=positions).logits
    for r, row in enumerate(rows):
        torch.testing.assert_close(logits[r], torch.cat([model(doc).logits[0] for doc in row]), atol=1e-10, rtol=0)


@pytest.mark.parametrize("flash_kwargs, position_ids", [(False, True), (True, True), (True, False)])
def test_the_padding_free_collator_feeds_the_model(pe_type, flash_kwargs, position_ids):
    """DataCollatorWithFlattening's batch (positions, or only cu_seq_lens) goes straight into the model: each
    document's logits are its own, and the loss is the documents' summed losses over all their targets, as
    transformers' loss counts them."""
    model = tiny_model(pe_type, dtype=torch.float64)
    docs = documents()
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs, return_position_ids=position_ids)
    batch = collator([{"input_ids": doc[0].tolist()} for doc in docs], return_tensors="pt")
    out = model(**{name: value.to(DEVICE) if torch.is_tensor(value) else value for name, value in batch.items()})
    torch.testing.assert_close(out.logits, torch.cat([model(doc).logits for doc in docs], dim=1), atol=1e-10, rtol=0)
    summed = sum(model(doc, labels=doc).loss * (doc.shape[1] - 1) for doc in docs)
    targets = sum(doc.shape[1] - 1 for doc in docs)
    torch.testing.assert_close(out.loss, summed / targets, atol=0, rtol=1e-6)  # the loss is float32


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 6), min_size=6, max_size=6), min_size=1, max_size=3))
def test_documents_are_found_as_transformers_finds_them(rows):
    positions = torch.tensor(rows, device=DEVICE)
    found, _ = packed_documents(positions, None, 0, True, *positions.shape)
    expected = find_packed_sequence_indices(positions)
    assert (found is None and expected is None) or torch.equal(found, expected)


def test_no_documents_with_a_mask_a_cache_or_bidirectional_attention():
    positions = torch.tensor([[0, 1, 2, 0, 1]], device=DEVICE)
    assert packed_documents(positions, None, 0, True, 1, 5)[0] is not None
    for mask, past, causal in ((torch.ones(1, 5, device=DEVICE), 0, True), (None, 3, True), (None, 0, False)):
        assert packed_documents(positions, mask, past, causal, 1, 5)[0] is None


def test_cu_seq_lens_that_do_not_describe_one_row_are_refused():
    model = tiny_model("rope")
    ids = tokens(2, 6)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE)
    for inputs, message in (
        (dict(input_ids=ids, cu_seq_lens_q=cu), "batch size 1"),
        (dict(input_ids=ids[:1], cu_seq_lens_q=cu, cu_seq_lens_k=torch.tensor([0, 3, 6], device=DEVICE)), "must equal"),
        (dict(input_ids=ids[:1], cu_seq_lens_q=torch.tensor([0, 2, 5], device=DEVICE)), "cumulative document lengths"),
    ):
        with pytest.raises(ValueError, match=message):
            model(**inputs)


def test_randpe_draws_each_packed_document_its_own_positions():
    """In training every document gets a sorted random subset of [0, M) of its own size, as alone: the expected
    r-th smallest of k draws from M is (r + 1)(M + 1)/(k + 1) - 1, whatever documents come before it."""
    config = tiny_model("randpe", randpe_max_position=128).config
    encoding = RandPE(config).train()
    ids, positions = packed(
        [torch.zeros(1, 9, dtype=torch.long, device=DEVICE), torch.zeros(1, 3, dtype=torch.long, device=DEVICE)]
    )
    docs, _ = packed_documents(positions, None, 0, True, *positions.shape)
    torch.manual_seed(0)
    draws = torch.stack([encoding.positions(positions, 0, docs)[0] for _ in range(3000)]).double()
    for span, k in ((slice(0, 9), 9), (slice(9, 12), 3)):
        assert (draws[:, span].diff(dim=-1) > 0).all()
        expected = (torch.arange(k, dtype=torch.float64, device=DEVICE) + 1) * 129 / (k + 1) - 1
        torch.testing.assert_close(draws[:, span].mean(0), expected, atol=1.5, rtol=0)
