"""The hook by which a layer's positional module computes the attention itself (`LayerPositional.attend`): the default
leaves the decoder's softmax attention in charge, and an override is what the decoder uses, on every path (the value
stream with TAPE's extra features, the cache, output_attentions), refused with a registered attention function."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AttentionInterface

from conftest import decode_in_chunks, tiny_model, tokens
from tapelm import PE_TYPES
from tapelm.kernels.attention import explicit_attention, joined_stream
from tapelm.positional import LayerPositional


def softmax_attend(self, q, k, stream, shared, mask, scale, ctx, probabilities=False):
    """The decoder's own attention (no bias), computed inside the hook."""
    out, probs = explicit_attention(q, k, joined_stream(stream, shared), mask.valid, mask.is_causal, scale)
    return out, probs if probabilities else None


def attending_itself(model):
    """`model` with every layer's positional module computing softmax attention through the hook."""
    calls = []
    for layer in model.model.layers:

        def attend(self, *args, **kwargs):
            calls.append(self)
            return softmax_attend(self, *args, **kwargs)

        layer.positional.attend = types.MethodType(attend, layer.positional)
    return model, calls


OWN_ATTENTION: set[str] = {"stickbreaking", "wall"}
"""The encodings whose layers compute the attention themselves."""


def test_the_default_hook_leaves_softmax_attention_to_the_decoder():
    """The default answers None, and only the encodings that attend themselves override it."""
    q = torch.randn(1, 4, 3, 8, dtype=torch.float64)
    k = v = torch.randn(1, 2, 3, 8, dtype=torch.float64)
    assert LayerPositional().attend(q, k, v, None, None, 1.0, None) is None
    for pe_type in PE_TYPES:
        overrides = type(tiny_model(pe_type).model.layers[0].positional).attend is not LayerPositional.attend
        assert overrides == (pe_type in OWN_ATTENTION), pe_type


@pytest.mark.parametrize("pe_type", ["tape", "rope", "alibi"])
def test_an_own_attention_equal_to_softmax_gives_the_decoders_logits_gradients_and_cache(pe_type):
    """A hook computing softmax attention (ALiBi's bias aside: the hook adds none, so it must differ) gives the
    default model's logits and gradients, uncached and decoded through a cache in chunks (TAPE's first layer keeps
    its extra features once per token: the hook sees them as `shared`)."""
    ids = tokens(2, 9)
    reference = tiny_model(pe_type, dtype=torch.float64)
    own, calls = attending_itself(tiny_model(pe_type, dtype=torch.float64))
    expected, got = reference(ids).logits, own(ids).logits
    assert len(calls) == own.config.num_hidden_layers
    if pe_type == "alibi":
        assert not torch.allclose(got, expected)
        return
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    expected.square().sum().backward()
    got.square().sum().backward()
    for (name, a), b in zip(reference.named_parameters(), own.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-9, atol=1e-12, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(decode_in_chunks(own, ids, [4, 1, 1, 3]), expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(
            own.generate(ids[:1, :4], max_new_tokens=4, do_sample=False),
            reference.generate(ids[:1, :4], max_new_tokens=4, do_sample=False),
        )


def test_output_attentions_returns_the_hooks_weights():
    ids = tokens(1, 7)
    reference = tiny_model("tape", dtype=torch.float64)
    own, _ = attending_itself(tiny_model("tape", dtype=torch.float64))
    with torch.no_grad():
        expected, got = reference(ids, output_attentions=True), own(ids, output_attentions=True)
    for a, b in zip(expected.attentions, got.attentions, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def test_a_registered_attention_function_is_refused_for_an_own_attention():
    """transformers' attention functions compute softmax attention: one cannot stand in for the hook's."""

    def zeroing(module, query, key, value, attention_mask, scaling, is_causal=True, **_):
        return query.new_zeros(*query.shape[:3], value.shape[-1]).transpose(1, 2), None

    AttentionInterface.register("test_own_attention_zero", zeroing)
    own, _ = attending_itself(tiny_model("rope"))
    own.set_attn_implementation("test_own_attention_zero")
    with pytest.raises(ValueError, match="computes its own"):
        own(tokens(1, 5))
