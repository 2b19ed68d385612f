"""Per-token work on the real tokens only (`tapelm.layout`) is the padded grid's function, gradients included."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import tiny_model, tokens
from tapelm.layout import TokenLayout


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=5, max_size=5), min_size=1, max_size=4))
def test_pack_and_unpack_are_inverse_on_real_tokens(rows):
    real = torch.tensor(rows)
    layout = TokenLayout(*real.shape, real.flatten().nonzero().squeeze(1))
    grid = torch.randn(*real.shape, 3)
    tokens_only = layout.pack(grid)
    assert tokens_only.shape == (int(real.sum()), 3)
    torch.testing.assert_close(layout.unpack(tokens_only), grid * real[..., None])
    torch.testing.assert_close(layout.pack(layout.unpack(tokens_only)), tokens_only)


def test_a_layout_without_padding_changes_nothing():
    grid = torch.randn(2, 5, 3)
    for layout in (
        TokenLayout.of(None, 2, 5),
        TokenLayout.of(torch.ones(2, 5, dtype=torch.bool), 2, 5),
        TokenLayout.of(torch.tensor([[True], [False]]), 2, 1),
    ):
        assert not layout.packed and layout.pack(grid) is grid and layout.unpack(grid) is grid


def test_skipping_padding_is_the_padded_grids_function(pe_type):
    """Training mode, left padding of several widths: logits at real tokens, the loss and every gradient agree."""
    model = tiny_model(pe_type, dtype=torch.float64, num_hidden_layers=3).train()
    ids = tokens(3, 11, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :9] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, -3:-1] = -100  # as the tasks' labels: some real tokens are not targets
    labels[[0, 1, 2], [0, 4, 9]] = -100  # the first real token: what predicts it is a padding position's logits
    results = []
    for skip in (True, False):
        model.model.skip_padding = skip
        model.zero_grad()
        torch.manual_seed(0)  # RandPE draws its positions in training
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results.append((out.logits[mask.bool()], out.loss, grads))
    (logits, loss, grads), (grid_logits, grid_loss, grid_grads) = results
    torch.testing.assert_close(logits, grid_logits, atol=1e-10, rtol=0)
    torch.testing.assert_close(loss, grid_loss, atol=1e-12, rtol=0)
    assert grads.keys() == grid_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], grid_grads[name], atol=1e-10, rtol=0, msg=name)
