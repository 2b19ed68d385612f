"""Cached decoding computes what a full forward pass computes, for every encoding."""

import pytest
import torch
from transformers import DynamicCache

from conftest import DEVICE, decode_in_chunks, tiny_model, tokens
from tapelm import PE_TYPES
from tapelm.cache import SHARED_STREAM
from tapelm.fast_paths import NONE
from tapelm.kernels.attention import AttentionMask, attend_stream, joined_stream
from tapelm.positional import encoding_class

pytestmark = pytest.mark.device


def test_cache_layers_hold_transformers_keys_and_values(pe_type):
    """One cache layer per decoder layer, each with transformers' (B, Hkv, T, d) keys and values (PoPE's keys are
    its complex features [m cos | m sin], 2d wide); the values are exactly the V projections of the tokens (tapelm's
    extra state lives beside them)."""
    model = tiny_model(pe_type, num_hidden_layers=3)
    ids = tokens(2, 9)
    cache = model(ids, use_cache=True).cache
    config, shape = model.config, (2, model.config.num_key_value_heads, 9, model.config.head_dim)
    key_shape = (*shape[:-1], shape[-1] * (2 if pe_type == "pope" else 1))
    assert len(cache.layers) == config.num_hidden_layers
    assert all(layer.keys.shape == key_shape and layer.values.shape == shape for layer in cache.layers)
    hidden = model(ids, output_hidden_states=True, use_cache=False).hidden_states
    for layer, block, x in zip(cache.layers, model.model.layers, hidden):
        v = block.self_attn.v_proj(block.input_layernorm(x, NONE)).view(2, 9, -1, config.head_dim).transpose(1, 2)
        torch.testing.assert_close(layer.values, v)


def test_tape_cache_keeps_e_beside_the_values():
    """TAPE's value stream [V | E] is one buffer whose first head_dim features are the layer's values. Where E enters
    the first layer it is E0, the same for every KV head: that layer holds V alone and E0 once per token beside it."""
    model = tiny_model("tape", num_hidden_layers=3)
    cache = model(tokens(2, 9), use_cache=True).cache
    d = model.config.head_dim
    streams = [layer.stream().shape[-1] for layer in cache.layers]
    assert streams == [d, 2 * d, d]  # E joins the values in the middle layer; the last one's E is discarded
    assert all(layer.stream()[..., :d].data_ptr() == layer.values.data_ptr() for layer in cache.layers)
    e0 = torch.cat(
        model.model.positional.rotary.tables(torch.arange(9, device=DEVICE).expand(2, -1), torch.float32), dim=-1
    )
    torch.testing.assert_close(cache.layers[0].state(SHARED_STREAM), e0[:, None], atol=0, rtol=0)
    assert [layer.state(SHARED_STREAM) is None for layer in cache.layers] == [False, True, True]


@pytest.mark.parametrize("queries", [1, 5])
@pytest.mark.parametrize("eager", [False, True])
def test_a_stream_part_shared_by_every_kv_head_attends_as_if_joined_to_each(queries, eager):
    """`attend_stream` given a part of the value stream once, (B, 1, T, F), for every KV head computes what it
    computes with that part joined to each head's V: both outputs and the gradients of q, k, V and the shared part,
    in float64, over cached keys with left padding and unwritten rows (a static cache's)."""
    generator = torch.Generator().manual_seed(0)
    q, k, v, shared, weight_v, weight_e = (
        torch.randn(*shape, dtype=torch.float64, generator=generator, device="cpu").to(DEVICE).requires_grad_()
        for shape in (
            (2, 4, queries, 8),
            (2, 2, 12, 8),
            (2, 2, 12, 8),
            (2, 1, 12, 6),
            (2, 4, queries, 8),
            (2, 4, queries, 6),
        )
    )
    valid = torch.ones(queries, 12, dtype=torch.bool, device=DEVICE).tril(12 - queries - 2).expand(2, 1, -1, -1)
    valid = valid.clone()
    valid[0, ..., :3] = False
    mask = AttentionMask(valid, False)

    def outputs(values, attended):
        loss = (values * weight_v).sum() + (attended * weight_e).sum()
        return values, attended, *torch.autograd.grad(loss, (q, k, v, shared))

    split = outputs(*attend_stream(q, k, v, 8, mask, None, 0.3, NONE, eager=eager, shared=shared))
    joined = outputs(*attend_stream(q, k, joined_stream(v, shared), 8, mask, None, 0.3, NONE, eager=eager))
    for name, actual, expected in zip(("V's output", "the rest's", "dq", "dk", "dV", "d shared"), split, joined):
        torch.testing.assert_close(actual, expected, atol=1e-12, rtol=1e-12, msg=name)


@pytest.mark.parametrize("pe_type", ["alibi", "t5", "fire"])
def test_relative_bias_reads_cached_key_positions(pe_type):
    """Custom positions (not 0..T-1) survive caching: the bias uses each key's own stored position. (The attention
    mask says the gaps are one sequence: without one, positions that jump start packed documents, as in
    transformers.)"""
    model = tiny_model(pe_type, dtype=torch.float64)
    ids = tokens(1, 10)
    positions = torch.tensor([[0, 1, 2, 10, 11, 12, 30, 31, 32, 33]], device=DEVICE)
    mask = torch.ones_like(ids)
    full = model(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    cache = DynamicCache(config=model.config)
    first = model(ids[:, :6], attention_mask=mask[:, :6], position_ids=positions[:, :6], cache=cache, use_cache=True)
    rest = model(ids[:, 6:], attention_mask=mask, position_ids=positions[:, 6:], cache=first.cache, use_cache=True)
    torch.testing.assert_close(torch.cat([first.logits, rest.logits], dim=1), full, atol=1e-10, rtol=0)


@pytest.mark.parametrize("pe_type", ["tape", "alibi"])
def test_beam_search_reorders_the_growing_cache(pe_type):
    """Beam search reorders and selects cache rows; the growing layers must follow (positions slot included)."""
    model = tiny_model(pe_type, dtype=torch.float64)
    ids = tokens(2, 6)
    kwargs = dict(max_new_tokens=8, do_sample=False, num_beams=3)
    assert torch.equal(model.generate(ids, use_cache=True, **kwargs), model.generate(ids, use_cache=False, **kwargs))


def test_growing_layer_crop_then_continue():
    """After a crop the layer keeps writing into its buffer and keeps decoding correctly."""
    model = tiny_model("tape", dtype=torch.float64)
    ids = tokens(1, 12)
    cache = DynamicCache(config=model.config)
    model(ids[:, :9], cache=cache, use_cache=True)
    assert type(cache.layers[0]).__name__ == "TapeCacheLayer"
    cache.crop(-3)
    rest = model(ids[:, 6:], cache=cache, use_cache=True).logits
    torch.testing.assert_close(rest, model(ids).logits[:, 6:], atol=1e-10, rtol=0)


def test_spare_capacity_holds_zeros_never_uninitialised_memory(pe_type):
    """Buffers grow with spare room along T; what is not written yet is zero (torch.export's tests compare whole
    cache buffers), also after the buffer grew and was copied."""
    model = tiny_model(pe_type)
    cache = DynamicCache(config=model.config)
    ids = tokens(2, 100)
    with torch.no_grad():  # as in generate (with gradients the cache concatenates instead)
        for start, size in ((0, 40), (40, 1), (41, 59)):  # the last step outgrows the first buffer
            model(ids[:, start : start + size], cache=cache, use_cache=True)
    for layer in cache.layers:
        for name, buffer in layer._buffers.items():
            spare = buffer[..., 100:, :]
            assert spare.shape[-2] > 0 and torch.equal(spare, torch.zeros_like(spare)), name


def test_a_static_cache_is_preallocated_and_never_grows(pe_type):
    """A StaticCache fed in chunks (its logits are the full pass's: `tapelm.testing.law_static_cache`) keeps each
    layer's buffers at its length, zeros beyond what was written; a fixed-shape layer hands attention every row."""
    from transformers import StaticCache

    model, ids = tiny_model(pe_type, dtype=torch.float64), tokens(2, 18)
    cache = StaticCache(config=model.config, max_cache_len=20)
    decode_in_chunks(model, ids, [7, 1, 1, 5, 4], cache)
    fixed = model.model.positional.fixed_shape_cache  # PaTH reads its cached keys as a sequence
    for layer in cache.layers:  # preallocated to its length, zeros beyond what was written, never grown
        assert type(layer).__name__ == ("FixedShapeCacheLayer" if fixed else "TapeCacheLayer")
        assert layer.get_max_cache_shape() == 20 and int(layer.get_seq_length()) == 18
        assert layer.keys.shape[-2] == (20 if fixed else 18)  # a fixed-shape layer hands attention every row
        for buffer in layer._buffers.values():
            assert buffer.shape[-2] == 20 and torch.equal(buffer[..., 18:, :], torch.zeros_like(buffer[..., 18:, :]))


def test_a_static_cache_refuses_to_overflow_in_one_line():
    from transformers import StaticCache

    model = tiny_model("tape")
    cache = StaticCache(config=model.config, max_cache_len=8)
    with torch.no_grad():
        model(tokens(1, 6), cache=cache, use_cache=True)
        with pytest.raises(ValueError, match="holds max_cache_len=8 tokens, and this step needs 9"):
            model(tokens(1, 3), cache=cache, use_cache=True)


COMPILED_DECODING = [pe for pe in PE_TYPES if encoding_class(pe).fixed_shape_cache]  # PaTH, Wall: sequences


def compile_config(**options):
    """generate's compile settings for the test device: inductor with CUDA graphs on a GPU (generate's default),
    dynamo's own backend on the CPU (the graph is captured the same; no C++ build in CI)."""
    from transformers import CompileConfig

    if DEVICE.type == "cuda":
        config = CompileConfig(**options)
    else:
        config = CompileConfig(backend="eager", mode=None, **options)
    config._compile_all_devices = True  # generate compiles on the GPU types it knows; tell it to here too
    return config


@pytest.mark.compiles
@pytest.mark.parametrize("pe_type", PE_TYPES)
def test_a_compiled_decode_step_on_a_static_cache_never_recompiles(pe_type):
    """generate with a static cache compiles the decode step (as it does on a GPU): one graph for every step and
    layer, no graph break, no recompilation over the steps, the tokens of the dynamic cache (left padding included)
    and of uncached decoding. PaTH and Wall read their caches as sequences, so they decode eagerly: transformers
    compiles nothing for them. Dynamo's own backend here; inductor and CUDA graphs under `pytest --device cuda`."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(pe_type)
    model.generation_config.compile_config = compile_config(fullgraph=True)
    ids = tokens(2, 6)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    dynamic = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        static = model.generate(
            ids, attention_mask=mask, max_new_tokens=10, do_sample=False, cache_implementation="static"
        )
    assert torch.equal(static, dynamic)
    assert torch.equal(
        static, model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, use_cache=False)
    )
    compiled = pe_type in COMPILED_DECODING
    assert counters["stats"]["unique_graphs"] == (1 if compiled else 0)
    assert (getattr(model, "_compiled_call", None) is not None) == compiled  # the decode steps went through it


@pytest.mark.compiles
def test_a_compiled_decode_step_computes_the_full_pass():
    """TAPE's compiled decoding step (its broadcast products over heads; dynamo's own backend) on a static cache: the
    logits of a full pass, in float64."""
    from transformers import StaticCache

    torch._dynamo.reset()
    model = tiny_model("tape", dtype=torch.float64)
    ids = tokens(2, 12)
    cache = StaticCache(config=model.config, max_cache_len=16)
    step = torch.compile(model, backend="eager", fullgraph=True, dynamic=False)
    logits = [model(ids[:, :6], cache=cache, use_cache=True).logits]
    logits += [step(ids[:, n : n + 1], cache=cache, use_cache=True).logits for n in range(6, 12)]
    torch.testing.assert_close(torch.cat(logits, dim=1), model(ids).logits, atol=1e-10, rtol=0)


def test_path_decodes_a_static_cache_eagerly():
    """PaTH reads its cached keys as a sequence: generate does not compile its decode step (TAPE's it does)."""
    from transformers import StaticCache

    for pe_type, compiles in (("path", False), ("tape", True)):
        model = tiny_model(pe_type)
        model.generation_config.compile_config = compile_config()
        cache = StaticCache(config=model.config, max_cache_len=16)
        assert model._valid_auto_compile_criteria({"cache": cache}, model.generation_config) == compiles
        assert type(cache.layers[0]).__name__ == ("FixedShapeCacheLayer" if compiles else "TapeCacheLayer")
