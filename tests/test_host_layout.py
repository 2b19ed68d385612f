"""A batch's host layout (`tapelm.layout.HostLayout`): what the batch maker knows on the host about padding and
packed documents, so that a training step reads nothing back from the device (a GPU would wait for each read), and
computes exactly what the step computes without it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import VOCAB, tiny_model
from tapelm import PE_TYPES
from tapelm.kernels.fla_layout import segments
from tapelm.layout import HostLayout
from tapelm.masks import build_attention_mask, packed_documents
from tapelm.modeling import TapeModel

LENGTH = 130
"""Tokens per row: more than one block of queries (`kernels.attention.blocks.BIAS_BLOCK`), so the blocked bias
attention runs too."""
KINDS = ("plain", "padded", "packed", "cu_seq_lens")
FAST_PATHS = ["attention-blocks"]
"""The fast paths the steps run: the CUDA one that also runs here. The CPU's own "attention-cpu-flash" reads the mask
where it lives (the host), so it is left out."""


class NoDeviceReads(TorchDispatchMode):
    """Refuses every operation whose result the host could only know by reading a tensor's values: a Python number
    or bool from a tensor (`item`, `bool`, `int`, `torch.equal`) or an output whose shape is data (`nonzero`,
    `unique`, boolean indexing)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.data_dependent_output in func.tags or (
            torch.Tag.dynamic_output_shape in func.tags
            and (func is not torch.ops.aten.index.Tensor or any(_is_mask(i) for i in args[1]))
        ):
            raise AssertionError(f"a read of the device: {func}")
        return func(*args, **kwargs)


def _is_mask(index) -> bool:
    return index is not None and index.dtype in (torch.bool, torch.uint8)


def batch(kind: str, length: int = LENGTH) -> dict:
    """Model inputs of one kind: plain rows, left-padded rows, rows packing documents (`position_ids` restarting), or
    one row of documents given by `cu_seq_lens_q`; with labels, as a training step takes them."""
    ids = torch.randint(0, VOCAB, (3, length), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids}
    if kind == "padded":
        mask = torch.ones_like(ids)
        mask[1, :40] = 0
        mask[2, : length - 3] = 0
        inputs["attention_mask"] = mask
    elif kind == "packed":
        inputs["position_ids"] = torch.cat([torch.arange(50), torch.arange(length - 70), torch.arange(20)])[None]
    elif kind == "cu_seq_lens":
        inputs = {"input_ids": ids[:1], "cu_seq_lens_q": torch.tensor([0, 30, 100, length])}
    labels = inputs["input_ids"].clone()
    if kind == "padded":
        labels[inputs["attention_mask"] == 0] = -100
    return {**inputs, "labels": labels}


def with_host_layout(inputs: dict) -> dict:
    shape = {k: v for k, v in inputs.items() if k != "labels"}
    return {**inputs, "host_layout": HostLayout.of(**shape)}


def training_step(pe_type: str, inputs: dict):
    """The loss and every gradient of one training-mode forward and backward pass of a tiny model."""
    model = tiny_model(pe_type, fast_paths=FAST_PATHS, max_position_embeddings=256).train()
    torch.manual_seed(0)  # RandPE draws its positions in training
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pe", PE_TYPES)
def test_a_training_step_with_its_host_layout_reads_nothing_from_the_device_and_computes_the_same(pe, kind) -> None:
    """Forward and backward of every encoding on every kind of batch, with the blocked bias attention: with its host
    layout the step reads nothing from the device, and its loss and every gradient equal, bit for bit, those of the
    same step without it."""
    inputs = batch(kind)
    with NoDeviceReads():
        loss, grads = training_step(pe, with_host_layout(inputs))
    expected_loss, expected = training_step(pe, inputs)
    assert torch.equal(loss, expected_loss)
    assert grads.keys() == expected.keys() and grads
    for name, grad in grads.items():
        assert torch.equal(grad, expected[name]), name


@pytest.mark.parametrize("kind", ["padded", "packed", "cu_seq_lens"])
def test_without_its_host_layout_a_step_reads_the_device(kind) -> None:
    """What the host layout saves: the mask, the padding skip and the documents are read back from the device."""
    with pytest.raises(AssertionError, match="a read of the device"), NoDeviceReads():
        training_step("rope", batch(kind))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=1, max_size=3), st.booleans())
def test_the_host_layout_finds_the_masks_segments_and_real_tokens(rows, dense) -> None:
    """Any 2D padding mask (left, right, holes): the segments fla would read from the mask, and the real tokens."""
    mask = torch.tensor(rows, dtype=torch.long)
    host = HostLayout.of(torch.zeros_like(mask), mask)
    valid = build_attention_mask(mask, None, 6, 6, causal=True, dense=dense, device=mask.device)
    expected = segments(valid, *mask.shape, 6)
    cuts = host.segments.cuts
    assert cuts is expected if not isinstance(expected, torch.Tensor) else torch.equal(cuts, expected)
    assert host.segments.shortest == shortest(expected, 6)
    assert host.padded == (not mask.bool().all())
    positions = TapeModel._position_ids(None, mask, 0, *mask.shape, mask.device)
    assert host.extent == (1, int(positions.max()) + 1)
    assert_distinct_rows(host, positions)
    assert host.index is None if not host.padded else host.index.tolist() == mask.flatten().nonzero()[:, 0].tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.integers(1, 2))
def test_the_host_layout_finds_the_documents_segments(lengths, batch_size) -> None:
    """Documents packed by restarting positions (rows of several) or by `cu_seq_lens_q` (one row)."""
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    length = positions.shape[1]
    ids = torch.zeros(batch_size, length, dtype=torch.long)
    cumulative = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    given = [(ids, {"position_ids": positions})] + ([(ids, {"cu_seq_lens_q": cumulative})] if batch_size == 1 else [])
    for inputs, documents_given in given:
        host = HostLayout.of(inputs, **documents_given)
        documents, positions = packed_documents(
            documents_given.get("position_ids"), None, 0, True, batch_size, length, documents_given.get("cu_seq_lens_q")
        )
        positions = documents_given.get("position_ids", positions)
        count = 1 if documents is None else int(documents.max()) + 1
        assert host.extent == (count, int(positions.max()) + 1)
        assert_distinct_rows(host, positions.expand(batch_size, -1))
        valid = build_attention_mask(None, documents, length, length, causal=True, dense=True, device=ids.device)
        expected = segments(valid, batch_size, length, length)
        cuts = host.segments.cuts
        assert cuts is expected if not isinstance(expected, torch.Tensor) else torch.equal(cuts, expected)
        assert host.documents == (len(lengths) > 1)
        assert host.segments.shortest == shortest(expected, length)


def shortest(cuts, length: int) -> int:
    """The shortest sequence of `segments`' answer `cuts` (rows of `length` tokens; 0 where it found none)."""
    if cuts is None or cuts is False:
        return length if cuts is None else 0
    return int((cuts[1:] - cuts[:-1]).min())


def assert_distinct_rows(host: HostLayout, positions: torch.Tensor) -> None:
    """The host's distinct rows of positions are `torch.unique`'s (FIRE's), in its order."""
    rows, index = torch.unique(positions, dim=0, return_inverse=True)
    first, host_index = host.distinct
    assert torch.equal(positions[first], rows) and torch.equal(host_index, index)


def test_a_host_layout_that_does_not_describe_the_batch_is_refused() -> None:
    model = tiny_model("rope")
    padded = batch("padded", 8)
    host = HostLayout.of(padded["input_ids"], padded["attention_mask"])
    with pytest.raises(ValueError, match=r"^host_layout describes a batch of shape \(3, 8\), not this one's \(3, 7\)$"):
        model(padded["input_ids"][:, 1:], attention_mask=padded["attention_mask"][:, 1:], host_layout=host)
    with pytest.raises(
        ValueError, match=r"^host_layout's tensors are on meta, the batch on cpu: move it with the batch"
    ):
        model(padded["input_ids"], attention_mask=padded["attention_mask"], host_layout=host.to("meta"))
    with pytest.raises(ValueError, match="^host_layout says the batch is padded: pass its 2D attention_mask$"):
        model(padded["input_ids"], host_layout=host)
    out = model(padded["input_ids"][:, :4], attention_mask=padded["attention_mask"][:, :4], use_cache=True)
    more = padded["input_ids"][:, 4:]
    with pytest.raises(
        ValueError, match="^host_layout describes a batch without cached tokens; pass it with no cache$"
    ):
        model(more, attention_mask=padded["attention_mask"], cache=out.cache, host_layout=HostLayout.of(more))
    packed = batch("cu_seq_lens", 8)
    host = HostLayout.of(packed["input_ids"], cu_seq_lens_q=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match=r"^host_layout's cu_seq_lens \(0, 8\) disagree with cu_seq_lens_q \(3,\)$"):
        model(packed["input_ids"], cu_seq_lens_q=torch.tensor([0, 4, 8]), host_layout=host)


def test_a_host_layout_moves_its_tensors_only() -> None:
    host = HostLayout.of(*batch("padded", 8).values())
    moved = host.to("meta")
    tensors = (moved.index, moved.segments.cuts, *moved.distinct)
    assert all(tensor.device.type == "meta" for tensor in tensors)
    assert (moved.shape, moved.padded, moved.segments.shortest) == (host.shape, host.padded, host.segments.shortest)


def test_the_learned_table_refuses_positions_beyond_it_as_the_host_layout_gives_them() -> None:
    model = tiny_model("learned", max_position_embeddings=8)
    ids = batch("plain", 9)["input_ids"]
    with pytest.raises(ValueError, match="^position 8 is beyond the learned table; pe_type='learned' allows"):
        model(ids, host_layout=HostLayout.of(ids))
