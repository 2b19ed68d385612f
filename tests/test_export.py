"""torch.export and torch.compile(fullgraph=True) trace the model with an attention mask or packed positions: no
Python branch reads a tensor's values, so one traced program serves every mask of its shapes, and it fills the cache
as eager code does. transformers' compiled decoding on a static cache is one graph, compiled once."""

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_model, tokens


class Logits(torch.nn.Module):
    """The causal LM's logits as a function of tensors only (what export takes)."""

    def __init__(self, model, keyword: str):
        super().__init__()
        self.model, self.keyword = model, keyword

    def forward(self, ids, extra):
        return self.model(input_ids=ids, use_cache=False, **{self.keyword: extra}).logits


def padding_masks(ids):
    left = torch.ones_like(ids)
    left[1, :3] = 0
    other = torch.ones_like(ids)
    other[0, :6] = 0
    return [left, other, torch.ones_like(ids)]


def assert_traced_equals_eager(traced, model, ids, masks, atol):
    for mask in masks:
        real = mask.bool()
        expected = model(ids, attention_mask=mask).logits
        # float32, and the traced program may order its sums differently: a few ulps of the logits' size
        torch.testing.assert_close(traced(ids, mask)[real], expected[real], atol=atol, rtol=1e-6)


class Prefill(torch.nn.Module):
    """A prompt's logits and every cache layer's keys and value stream after it, as a function of tensors only."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, mask):
        cache = DynamicCache(config=self.model.config)
        logits = self.model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits
        return logits, *(tensor for layer in cache.layers for tensor in (layer.keys, layer.stream()))


def test_an_exported_prefill_computes_the_logits_and_fills_the_cache_as_eager_code_does(pe_type):
    """With left padding of several widths: the logits at real tokens, and every cached key and value-stream entry,
    padding positions included (traced code runs the per-token work on the whole grid, eager code on the real
    tokens only, leaving zeros on the grid). In float64: a fast path that reads a tensor's value on the host (Wall's
    anchored one) is left out of a traced program, which then computes the same function by the reference path."""
    model = tiny_model(pe_type, dtype=torch.float64)
    ids = tokens(2, 9)
    masks = padding_masks(ids)
    program = torch.export.export(Prefill(model), (ids, masks[0])).module()
    for mask in masks:
        (logits, *cached), (expected, *expected_cached) = program(ids, mask), Prefill(model)(ids, mask)
        real = mask.bool()
        torch.testing.assert_close(logits[real], expected[real], atol=1e-6, rtol=1e-6)
        assert len(cached) == len(expected_cached) == 2 * model.config.num_hidden_layers
        for got, want in zip(cached, expected_cached):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("pe_type", ["tape", "fire", "randpe", "path"])
def test_export_with_packed_positions(pe_type):
    model = tiny_model(pe_type)
    ids = tokens(1, 9)
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2]])
    program = torch.export.export(Logits(model, "position_ids"), (ids, packed)).module()
    for positions in (packed, torch.arange(9)[None], torch.tensor([[0, 0, 1, 2, 3, 4, 0, 1, 2]])):
        expected = model(ids, position_ids=positions).logits
        torch.testing.assert_close(program(ids, positions), expected, atol=1e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("pe_type", ["fire", "learned"])
def test_compile_fullgraph_with_an_attention_mask(pe_type):
    torch._dynamo.reset()
    model = tiny_model(pe_type, num_hidden_layers=1)
    ids = tokens(2, 9)
    # AOTAutograd's trace without inductor's code generation: fullgraph is dynamo's law (test_train_step.py runs
    # inductor; its C++ build here took 20 s on a cold cache)
    compiled = torch.compile(Logits(model, "attention_mask"), fullgraph=True, backend="aot_eager")
    assert_traced_equals_eager(compiled, model, ids, padding_masks(ids), atol=1e-4)
