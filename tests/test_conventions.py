"""transformers conventions: output_attentions, the caches tapelm supports, generate in training mode with activation
checkpointing, and per-model attention functions."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import tiny_config, tiny_model, tokens
from tapelm import TapeForCausalLM


def llama_twin(kv_heads: int = 2) -> tuple[LlamaForCausalLM, TapeForCausalLM]:
    """transformers' Llama and tapelm's RoPE model with the same random weights."""
    rope = {"rope_type": "default", "rope_theta": 500.0}
    config = tiny_config("rope", num_key_value_heads=kv_heads, rope_parameters=dict(rope))
    torch.manual_seed(0)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=kv_heads,
            rope_parameters=dict(rope),
            max_position_embeddings=128,
            attn_implementation="eager",
        )
    )
    llama.generation_config.eos_token_id = None  # generate as long as asked, like tapelm's tiny model
    ours = TapeForCausalLM(config)
    ours.load_state_dict(llama.state_dict())
    return llama.eval(), ours.eval()


def test_output_attentions_are_probabilities_that_change_nothing(pe_type):
    """For every encoding: one (B, H, N, T) tensor per layer whose rows are distributions over the visible keys
    (stick-breaking's sum to at most 1; none on the future or on padding), and the logits equal those of a call
    without attentions."""
    model = tiny_model(pe_type)
    ids = tokens(2, 12)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True)
        plain = model(ids, attention_mask=mask)
    torch.testing.assert_close(out.logits[1, 3:], plain.logits[1, 3:], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.logits[0], plain.logits[0], atol=1e-5, rtol=0)
    assert plain.attentions is None
    assert len(out.attentions) == model.config.num_hidden_layers
    future = torch.ones(12, 12, dtype=torch.bool).triu(1)
    for probs in out.attentions:
        assert probs.shape == (2, model.config.num_attention_heads, 12, 12)
        if pe_type == "stickbreaking":  # the stick a query leaves over is dropped: at most 1
            assert probs.min() >= 0 and probs.sum(-1).max() <= 1 + 1e-6
        else:
            torch.testing.assert_close(probs.sum(-1), torch.ones(2, probs.shape[1], 12))
        assert probs[..., future].abs().max() == 0
        assert probs[1, :, 3:, :3].abs().max() == 0


def test_output_attentions_equal_llamas():
    llama, ours = llama_twin()
    ids = tokens(2, 16)
    with torch.no_grad():
        expected = llama(ids, output_attentions=True).attentions
        got = ours(ids, output_attentions=True).attentions
    for theirs, mine in zip(expected, got, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)


def test_output_attentions_work_while_decoding_with_the_cache(pe_type):
    """The probabilities of the last token after a cached prefix equal those of the full forward pass."""
    model = tiny_model(pe_type)
    ids = tokens(1, 10)
    with torch.no_grad():
        full = model(ids, output_attentions=True).attentions
        prefix = model(ids[:, :-1], use_cache=True)
        step = model(ids[:, -1:], cache=prefix.cache, output_attentions=True).attentions
    for whole, last in zip(full, step, strict=True):
        torch.testing.assert_close(last[:, :, 0], whole[:, :, -1], atol=1e-5, rtol=0)


def test_an_offloaded_cache_is_refused_in_one_line_before_anything_is_written():
    from transformers import StaticCache

    model = tiny_model("tape")
    with pytest.raises(ValueError, match="^tapelm caches cannot be offloaded[^\n]*'dynamic' or 'static'$"):
        model.generate(tokens(1, 5), max_new_tokens=3, do_sample=False, cache_implementation="offloaded_static")
    cache = StaticCache(config=model.config, max_cache_len=16, offloading=True)
    with pytest.raises(ValueError, match="cannot be offloaded"):
        model(tokens(1, 5), cache=cache)
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize("pe_type", ["rope", "tape"])
def test_generate_in_training_mode_with_checkpointing_does_what_llama_does(pe_type):
    """With activation checkpointing in training mode, transformers' Llama turns caching off while gradients are on
    (with a warning) and caches as usual in generate (no gradients: nothing is checkpointed); tapelm's model does the
    same, token for token, and a fresh TAPE model is RoPE, so both equal Llama's."""
    llama, ours = llama_twin()
    if pe_type == "tape":
        tape = TapeForCausalLM(
            tiny_config("tape", num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
        )
        tape.load_state_dict(ours.state_dict(), strict=False)
        ours = tape
    ids = tokens(1, 6)
    outputs = []
    for model in (llama, ours):
        model.activation_checkpointing_enable()
        model.train()
        assert model(ids, use_cache=True).cache is None
        outputs.append(model.generate(ids, max_new_tokens=5, do_sample=False))
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(outputs[1], ours.eval().generate(ids, max_new_tokens=5, do_sample=False))


def test_a_registered_attention_function_is_per_model():
    """A function registered with transformers' `AttentionInterface` and set as one model's attn_implementation
    computes its attention (called as transformers' models call it); an identical model beside it keeps tapelm's."""
    from transformers import AttentionInterface

    first, second = tiny_model("tape"), tiny_model("tape")
    calls = []

    def zeroing(module, query, key, value, attention_mask, scaling, is_causal=True, **_):
        calls.append((module.layer_idx, query.shape, value.shape, is_causal))
        return query.new_zeros(*query.shape[:3], value.shape[-1]).transpose(1, 2), None

    AttentionInterface.register("test_zero_attention", zeroing)
    ids = tokens(1, 8)
    with torch.no_grad():
        reference = second(ids).logits
        first.set_attn_implementation("test_zero_attention")
        zeroed, untouched = first(ids).logits, second(ids).logits
        first.set_attn_implementation("sdpa")
        restored = first(ids).logits
    assert [layer for layer, *_ in calls] == list(range(first.config.num_hidden_layers))
    assert all(causal and query[-2] == 8 for _, query, _, causal in calls)
    assert torch.equal(untouched, reference) and torch.equal(restored, reference)
    assert not torch.allclose(zeroed, reference)
    first.set_attn_implementation("test_zero_attention")
    with pytest.raises(ValueError, match="output_attentions"):
        first(ids, output_attentions=True)


def test_assisted_and_prompt_lookup_decoding_equal_greedy(pe_type):
    """Speculative decoding crops the cache after rejected draft tokens: the text must be greedy's."""
    if pe_type == "path":
        pytest.skip("PaTH's cached keys already carry later tokens' transforms: cropping is not supported")
    model, assistant = tiny_model(pe_type), tiny_model(pe_type, seed=1)
    ids = tokens(1, 6)
    greedy = model.generate(ids, max_new_tokens=6, do_sample=False)
    assisted = model.generate(ids, max_new_tokens=6, do_sample=False, assistant_model=assistant)
    lookup = model.generate(ids, max_new_tokens=6, do_sample=False, prompt_lookup_num_tokens=2)
    assert torch.equal(assisted, greedy) and torch.equal(lookup, greedy)


def test_generate_returns_attentions_per_step():
    model = tiny_model("tape")
    out = model.generate(
        tokens(1, 5), max_new_tokens=3, do_sample=False, output_attentions=True, return_dict_in_generate=True
    )
    assert len(out.attentions) == 3
    assert out.attentions[0][0].shape[-2:] == (5, 5) and out.attentions[2][0].shape[-2:] == (1, 7)


def test_a_forward_without_input_says_what_to_give():
    with pytest.raises(ValueError, match="give exactly one of input_ids or inputs_embeds"):
        tiny_model("tape")(input_ids=None)
