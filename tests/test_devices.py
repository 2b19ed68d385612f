"""No tensor is made on the default device inside the model: every path of every encoding, watched on the CPU.

On a GPU a tensor made without a device lands on the CPU and either crashes the forward pass or costs a copy in every
step; CI has no GPU, so `FactoryWatch` flags the factory calls themselves, with their file and line."""

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_model, tokens
from device_checks import FactoryWatch

pytestmark = pytest.mark.device


def padded(ids):
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return mask


def packed_positions(ids):
    half = ids.shape[1] // 2
    return torch.cat([torch.arange(half, device=ids.device), torch.arange(ids.shape[1] - half, device=ids.device)])


def four_d(ids):
    length = ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
    return (causal[None, None] & padded(ids).bool()[:, None, None, :]).expand(ids.shape[0], 1, -1, -1)


def train_step(model, ids, **inputs):
    model.train()
    try:
        model(ids, labels=ids, **inputs).loss.backward()
    finally:
        model.eval()


def continue_cache(model, ids, sizes):
    cache, start = DynamicCache(config=model.config), 0
    for size in sizes:  # no attention mask: positions continue from the cache
        model(ids[:, start : start + size], cache=cache, use_cache=True)
        start += size


PATHS = {
    "plain training batch": lambda model, ids: train_step(model, ids),
    "padded training batch": lambda model, ids: train_step(model, ids, attention_mask=padded(ids)),
    "packed documents": lambda model, ids: train_step(model, ids, position_ids=packed_positions(ids)[None]),
    "cu_seq_lens": lambda model, ids: model(
        ids[:1], cu_seq_lens_q=torch.tensor([0, 4, ids.shape[1]], device=ids.device)
    ),
    "4D mask": lambda model, ids: model(ids, attention_mask=four_d(ids)),
    "cached prefill then several tokens without a mask": lambda model, ids: continue_cache(model, ids, [5, 3, 1, 1]),
    "generate": lambda model, ids: model.generate(ids, attention_mask=padded(ids), max_new_tokens=4, do_sample=False),
    "beam search": lambda model, ids: model.generate(ids, max_new_tokens=3, do_sample=False, num_beams=2),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_no_tensor_is_made_on_the_default_device(pe_type, path):
    model = tiny_model(pe_type)
    ids = tokens(2, 10)
    with FactoryWatch() as watch:
        PATHS[path](model, ids)
    assert not watch.calls, f"{pe_type}, {path}: tensors made without a device: {sorted(set(watch.calls))}"


def test_the_watch_sees_a_factory_without_a_device():
    """The check is not vacuous: a factory call without a device inside tapelm's code is reported with its line."""
    from tapelm import masks

    with FactoryWatch() as watch:
        masks.AttentionMask(torch.ones(1), False)  # a test's own call: not tapelm's code, not reported
        exec(compile("import torch\ntorch.arange(3)", masks.__file__, "exec"))
    assert watch.calls == ["torch.arange at tapelm/masks.py:2"]
