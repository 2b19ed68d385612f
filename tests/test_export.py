"""torch.export and torch.compile(fullgraph=True) trace the model with an attention mask or packed positions: no
Python branch reads a tensor's values, so one traced program serves every mask of its shapes."""

import pytest
import torch

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


def test_export_with_an_attention_mask(pe_type):
    model = tiny_model(pe_type)
    ids = tokens(2, 9)
    masks = padding_masks(ids)
    program = torch.export.export(Logits(model, "attention_mask"), (ids, masks[0]))
    assert_traced_equals_eager(program.module(), model, ids, masks, atol=1e-6)


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
    compiled = torch.compile(Logits(model, "attention_mask"), fullgraph=True)
    assert_traced_equals_eager(compiled, model, ids, padding_masks(ids), atol=1e-4)
