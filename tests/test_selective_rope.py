"""Selective RoPE's laws: tapelm's attention logits and every gradient equal the authors' layer
(tests/selective_rope_reference.py) in float64, for each of its options; grouped-query attention is multi-head
attention with each KV head's phases repeated over its group; and where the authors' layer is not a reference
(padding, a cache, packed documents, bf16, save/load, compile) the conformance kit's laws hold
(tests/test_conformance.py runs them for every registered encoding)."""

from __future__ import annotations

import pytest
import torch

import selective_rope_reference as ref
from conftest import DEVICE, first_layer_logits, tiny_config, tiny_model, tokens
from tapelm import TapeForCausalLM

HEADS, DIM, HIDDEN, LENGTH = 4, 8, 32, 12

OPTIONS = [
    ({}, {}),
    ({"selective_rope_bias": True}, {"use_bias": True}),
    ({"selective_rope_gate": "standard"}, {"use_gate": True, "gate_parametrization": "standard"}),
    (
        {"selective_rope_gate": "low-rank", "selective_rope_conv_activation": "silu"},
        {"use_gate": True, "gate_parametrization": "low-rank", "conv_act": "silu"},
    ),
    (
        {"selective_rope_gate": "gla", "selective_rope_bias": True, "selective_rope_theta": 100.0},
        {"use_gate": True, "gate_parametrization": "gla", "use_bias": True, "temp_theta": 100.0},
    ),
    ({"selective_rope_conv_size": 2, "selective_rope_temperature": 3.0}, {"temp_max": 3.0}),
]
IDS = ["default", "bias", "gate-standard", "gate-low-rank-silu", "gate-gla-bias-theta", "conv2-temperature"]


def authors_weights(model) -> dict:
    """The first layer's weights in the authors' names and layout (views of tapelm's parameters: gradients reach
    them)."""
    layer = model.model.layers[0]
    positional = layer.positional
    chain = [(linear.weight, linear.bias) for linear in positional.phase_proj]
    weights = {
        "q_proj": layer.self_attn.q_proj.weight,
        "k_proj": layer.self_attn.k_proj.weight,
        "phi_proj": chain,
        "phi_conv1d": positional.phase_conv.weight,
    }
    if positional.phase_bias is not None:
        weights["phi_bias"] = positional.phase_bias.bias[None, None]
    if positional.gate is not None:
        linears = [positional.gate] if isinstance(positional.gate, torch.nn.Linear) else list(positional.gate)
        weights["phase_gate_proj"] = [(linear.weight, linear.bias) for linear in linears]
    return weights


@pytest.mark.parametrize(("options", "theirs"), OPTIONS, ids=IDS)
def test_the_logits_and_every_gradient_equal_the_authors(options, theirs):
    model = tiny_model("selective-rope", dtype=torch.float64, num_key_value_heads=HEADS, **options)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, LENGTH, HIDDEN, generator=generator, dtype=torch.float64).to(DEVICE).requires_grad_()
    ours = first_layer_logits(model, x)
    reference = ref.selective_rope_logits(x, authors_weights(model), HEADS, DIM, theirs)
    visible = torch.isfinite(reference)
    assert torch.equal(visible, torch.isfinite(ours))
    torch.testing.assert_close(ours[visible], reference[visible], rtol=1e-10, atol=1e-10)
    cotangent = torch.randn(reference.shape, generator=generator, dtype=torch.float64).to(DEVICE)
    leaves = [
        x,
        *model.model.layers[0].self_attn.q_proj.parameters(),
        *model.model.layers[0].self_attn.k_proj.parameters(),
    ]
    leaves += list(model.model.layers[0].positional.parameters())
    expected = torch.autograd.grad((reference.where(visible, 0) * cotangent).sum(), leaves, allow_unused=True)
    got = torch.autograd.grad((ours.where(visible, 0) * cotangent).sum(), leaves, allow_unused=True)
    for leaf, mine, theirs_grad in zip(leaves, got, expected, strict=True):
        assert mine is not None and theirs_grad is not None, leaf.shape
        torch.testing.assert_close(mine, theirs_grad, rtol=1e-9, atol=1e-10)


def test_grouped_query_heads_share_their_kv_heads_phases():
    """With 2 KV heads for 4 query heads, the model equals the multi-head model whose k, v and phase rows are each KV
    head's repeated over its group (the authors' layer needs as many KV heads as query heads)."""
    grouped = tiny_model("selective-rope", dtype=torch.float64, selective_rope_gate="gla", selective_rope_bias=True)
    full = (
        TapeForCausalLM(
            tiny_config(
                "selective-rope", num_key_value_heads=HEADS, selective_rope_gate="gla", selective_rope_bias=True
            )
        )
        .double()
        .eval()
    )
    group, pairs = HEADS // grouped.config.num_key_value_heads, DIM // 2
    state = {}
    for name, value in grouped.state_dict().items():
        if any(part in name for part in ("k_proj", "v_proj")):
            value = value.unflatten(0, (-1, DIM)).repeat_interleave(group, 0).flatten(0, 1)
        elif any(part in name for part in ("phase_proj.1", "phase_conv", "gate.1")):
            value = value.unflatten(0, (-1, pairs)).repeat_interleave(group, 0).flatten(0, 1)
        elif "phase_bias" in name:
            value = value.repeat_interleave(group, 0)
        state[name] = value
    full.load_state_dict(state)
    ids = tokens(2, 10, seed=3)
    torch.testing.assert_close(full(ids).logits, grouped(ids).logits, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"selective_rope_gate": "sigmoid"}, "selective_rope_gate='sigmoid' is not allowed"),
        ({"selective_rope_rank": 0}, "selective_rope_rank=0 is not allowed"),
        ({"selective_rope_conv_activation": "relu"}, "selective_rope_conv_activation='relu' is not allowed"),
        ({"selective_rope_theta": -1.0}, "selective_rope_theta=-1.0 is not allowed"),
        ({"head_dim": 7, "hidden_size": 28}, "head_dim=7 must be even"),
    ],
)
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=message):
        tiny_config("selective-rope", **options)
