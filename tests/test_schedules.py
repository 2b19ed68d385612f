"""Per-layer position schedules (`layer_pe_types`): a schedule of one encoding is that encoding; in a mix every layer
computes what the model of its encoding computes there; transformers' SmolLM3 (NoPE every fourth layer) converts
exactly; RoPE's older `rope_layers` is the RoPE/NoPE schedule; and a mix takes every user path a single encoding
takes (padding, packing, dynamic, static and compiled caches, torch.export, save/load, bf16 autocast)."""

import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, DynamicCache, SmolLM3Config, SmolLM3ForCausalLM

from conftest import DEVICE, WEIGHT_STD, decode_in_chunks, randomize, tiny_config, tiny_model, tokens
from tapelm import PE_TYPES
from tapelm.conversion import from_pretrained_llama
from tapelm.fast_paths import PATHS, resolve
from tapelm.positional import layer_encodings, registered
from tapelm.positional.schedule import acts_outside_layers
from tapelm.testing import LAWS, Subject, forward_and_gradients
from test_cache import compile_config
from test_export import Prefill, padding_masks

pytestmark = pytest.mark.device

LAYERS = 4
MIXABLE = [name for name, encoding in registered().items() if acts_outside_layers(encoding) is None]
SCHEDULES = {
    "smollm3": dict(pe_type="rope", layer_pe_types="nope-every-4th"),
    "tape-nope": dict(pe_type="tape", layer_pe_types="nope-every-2nd"),
    "tape-rope-alibi": dict(pe_type="tape", layer_pe_types=["rope", "tape", "alibi", "tape"]),
    "fox-t5-path-grape": dict(pe_type="rope", layer_pe_types=["fox", "t5", "path", "grape-a-qk"]),
}
"""Representative mixes: SmolLM3's, TAPE's state through NoPE layers, TAPE beside a rotary and a bias encoding, and
contextual peers beside a learned bias (PaTH's cache is read as a sequence, FoX's and GRAPE-A's are causal only)."""


@pytest.mark.parametrize("law", [law for law in LAWS if law != "compiles"])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_a_mix_obeys_every_law(name, law):
    """The conformance kit's laws hold for a mix as for each encoding alone (cache, generation, left padding, packed
    documents, positions, relative where every member is, bf16, save and load, gradients)."""
    options = {**SCHEDULES[name], "num_hidden_layers": LAYERS}
    LAWS[law](Subject(options.pop("pe_type"), DEVICE, WEIGHT_STD, options))


def scheduled(name: str, dtype=torch.float64, **overrides):
    return tiny_model(dtype=dtype, num_hidden_layers=LAYERS, **{**SCHEDULES[name], **overrides})


def renamed(state: dict, old: str, new: str) -> dict:
    return {(new + key[len(old) :] if key.startswith(old) else key): value for key, value in state.items()}


@pytest.mark.parametrize("encoding", PE_TYPES)
def test_a_schedule_of_one_encoding_computes_that_encoding(encoding):
    """Every layer X (with another `pe_type`, so that only the schedule can make it X) computes pe_type=X's logits
    and every gradient, the same weights under the schedule's names."""
    plain = tiny_model(encoding, dtype=torch.float64, num_hidden_layers=3)
    other = "rope" if encoding == "nope" else "nope"
    model = tiny_model(other, dtype=torch.float64, num_hidden_layers=3, layer_pe_types=[encoding] * 3)
    prefix = f"model.positional.encodings.{encoding}."
    model.load_state_dict(renamed(plain.state_dict(), "model.positional.", prefix))
    ids = tokens(2, 11)
    generator = torch.Generator().manual_seed(3)
    weights = torch.randn(2, 11, 61, dtype=torch.float64, generator=generator, device="cpu").to(DEVICE)
    logits, grads = forward_and_gradients(model, ids, weights)
    expected, expected_grads = forward_and_gradients(plain, ids, weights)
    torch.testing.assert_close(logits, expected, atol=1e-12, rtol=0)
    assert grads.keys() == renamed(expected_grads, "model.positional.", prefix).keys() and grads
    for name, grad in renamed(expected_grads, "model.positional.", prefix).items():
        torch.testing.assert_close(grads[name], grad, atol=1e-12, rtol=0, msg=name)


def layer_calls(model, ids) -> list[tuple]:
    """Each decoder layer's (hidden, state) going in and coming out in a forward pass of `ids`."""
    calls, handles = [], []
    for layer in model.model.layers:
        handles.append(layer.register_forward_hook(lambda module, args, out: calls.append((args[:2], out[:2]))))
    try:
        model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def run_layer_on(model, index: int, inputs: tuple, ids):
    """Layer `index` of `model`, given `inputs` (hidden, state) in its own forward pass of `ids` (its own context)."""
    layer, outputs = model.model.layers[index], {}

    def replace(module, args):
        return (*inputs, *args[2:])

    def keep(module, args, out):
        outputs["out"] = out[:2]

    handles = (layer.register_forward_pre_hook(replace), layer.register_forward_hook(keep))
    try:
        model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return outputs["out"]


def encoding_model(mixed, encoding: str, schedule: list[str]):
    """A model of `encoding` in every layer, holding the mixed model's weights: the shared ones, that encoding's
    model level and the layers of that encoding."""
    reference = tiny_model(encoding, dtype=torch.float64, num_hidden_layers=len(schedule))
    state = renamed(mixed.state_dict(), f"model.positional.encodings.{encoding}.", "model.positional.")
    other_layers = tuple(f"model.layers.{i}.positional." for i, name in enumerate(schedule) if name != encoding)
    kept = {
        key: value
        for key, value in state.items()
        if not key.startswith(other_layers) and not key.startswith("model.positional.encodings.")
    }
    reference.load_state_dict(kept, strict=False)
    return reference


@settings(max_examples=12, deadline=None)
@given(st.lists(st.sampled_from(MIXABLE), min_size=3, max_size=3).filter(lambda names: len(set(names)) > 1))
def test_each_layer_of_a_mix_computes_its_encodings_layer(schedule):
    """Given the same input (hidden states and positional state), layer k of any mix gives the output of layer k of
    the model of its encoding (with the same weights), in that model's own forward pass: each encoding sees its own
    context. The positional state leaves a layer as that model's layer leaves it, or unchanged where the mix's layer
    does not update it (a layer of another encoding, or the mix's last TAPE layer)."""
    mixed = tiny_model("nope", dtype=torch.float64, num_hidden_layers=3, layer_pe_types=schedule)
    ids = tokens(2, 9)
    references = {name: encoding_model(mixed, name, schedule) for name in set(schedule)}
    for index, ((inputs, (hidden, state))) in enumerate(layer_calls(mixed, ids)):
        reference = references[schedule[index]]
        expected_hidden, expected_state = run_layer_on(reference, index, inputs, ids)
        torch.testing.assert_close(hidden, expected_hidden, atol=1e-12, rtol=0, msg=f"layer {index}")
        names = [name for name, _ in mixed.model.layers[index].positional.named_parameters()]
        if names == [name for name, _ in reference.model.layers[index].positional.named_parameters()]:
            assert (state is None) == (expected_state is None)
            if state is not None:
                torch.testing.assert_close(state, expected_state, atol=1e-12, rtol=0, msg=f"layer {index}")
        else:
            assert state is inputs[1]


def smollm3(**options) -> SmolLM3ForCausalLM:
    config = SmolLM3Config(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **options,
    )
    torch.manual_seed(0)
    with torch.device(DEVICE):
        return randomize(SmolLM3ForCausalLM(config)).to(torch.float64).eval()


@pytest.mark.parametrize("pe_type", ["rope", "tape"])
def test_smollm3_converts_to_its_schedule_exactly(pe_type):
    """transformers' SmolLM3 (NoPE in every fourth layer) converts to tapelm's "nope-every-4th" schedule of RoPE (or
    TAPE, which computes RoPE's function at its initialisation) with the same logits in float64 (to 1e-5: SmolLM3's
    norms and rotary tables compute in float32 whatever the model's dtype; a layer rotated wrongly changes them by
    ~1)."""
    source, ids = smollm3(), tokens(2, 14)
    model = from_pretrained_llama(source, pe_type=pe_type)
    preset = tiny_config(pe_type, num_hidden_layers=5, layer_pe_types="nope-every-4th")
    assert layer_encodings(model.config) == layer_encodings(preset) == [pe_type] * 3 + ["nope", pe_type]
    torch.testing.assert_close(model(ids).logits, source(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rope_layers, no_rope_layers", [("nope-every-4th", None), ([0, 2, 3], [1, 0, 1, 1, 0])])
def test_rope_layers_computes_smollm3s_schedule(rope_layers, no_rope_layers):
    """A saved config's `rope_layers` still computes its RoPE/NoPE schedule: SmolLM3's logits with SmolLM3's weights
    (to SmolLM3's float32 norms and tables), the same as the `layer_pe_types` spelling, with the state-dict names of a
    plain RoPE model."""
    source, ids = smollm3(no_rope_layers=no_rope_layers), tokens(2, 14)
    old = tiny_model("rope", dtype=torch.float64, num_hidden_layers=5, rope_layers=rope_layers)
    schedule = layer_encodings(old.config)
    new = tiny_model("rope", dtype=torch.float64, num_hidden_layers=5, layer_pe_types=schedule)
    assert old.state_dict().keys() == tiny_model("rope", num_hidden_layers=5).state_dict().keys()
    for model in (old, new):
        model.load_state_dict(source.state_dict())
        torch.testing.assert_close(model(ids).logits, source(ids).logits, atol=1e-5, rtol=0)


def test_a_folder_saved_before_layer_pe_types_loads_and_computes_the_same(tmp_path):
    """A config.json written before `layer_pe_types` existed (without the field) loads as its `rope_layers` schedule."""
    model, ids = tiny_model("rope", num_hidden_layers=5, rope_layers="nope-every-4th"), tokens(2, 10)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["layer_pe_types"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).to(DEVICE).eval()
    assert loaded.config.layer_pe_types is None and layer_encodings(loaded.config) == layer_encodings(model.config)
    assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_a_mix_under_bf16_autocast_stays_near_float64_and_decodes_as_its_full_pass(name):
    """bf16 autocast's logits within 5% (RMS) of the float64 model's, finite gradients, and cached decoding within
    1.5x the full pass's own bf16 error (as tests/test_numerics.py asks of every encoding)."""
    reference, ids = scheduled(name, std=0.15), tokens(2, 16)  # logits in a realistic range, as test_numerics's
    model = scheduled(name, std=0.15).float()

    def rms(x):
        return x.double().pow(2).mean().sqrt().item()

    expected = reference(ids).logits
    with torch.no_grad(), torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        full = model(ids, use_cache=False).logits
        cached = decode_in_chunks(model, ids, [9, 1, 6])
    assert rms(full - expected) < 0.05 * rms(expected)
    assert rms(cached - full) <= 1.5 * rms(full - expected)
    model.train()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.compiles
@pytest.mark.parametrize("name", ["smollm3", "tape-rope-alibi"])
def test_a_mix_compiles_its_decode_step_on_a_static_cache_without_recompiling(name):
    """As tests/test_cache.py asks of every encoding: one graph for the decode step, none again over the steps, the
    dynamic cache's tokens (each layer's context view is traced as the layer's own)."""
    torch._dynamo.reset()
    model = scheduled(name, dtype=torch.float32)
    model.generation_config.compile_config = compile_config(fullgraph=True)
    ids = tokens(2, 6)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    dynamic = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        static = model.generate(
            ids, attention_mask=mask, max_new_tokens=10, do_sample=False, cache_implementation="static"
        )
    assert torch.equal(static, dynamic) and model._compiled_call is not None


@pytest.mark.parametrize("name", ["smollm3", "tape-rope-alibi"])
def test_an_exported_prefill_of_a_mix_computes_what_eager_code_does(name):
    """torch.export traces a mix once for every padding mask of its shapes (as tests/test_export.py asks of every
    encoding): the logits at real tokens and every cached key and value stream."""
    model, ids = scheduled(name, dtype=torch.float32), tokens(2, 9)
    masks = padding_masks(ids)
    program = torch.export.export(Prefill(model), (ids, masks[0])).module()
    for mask in masks:
        (logits, *cached), (expected, *expected_cached) = program(ids, mask), Prefill(model)(ids, mask)
        torch.testing.assert_close(logits[mask.bool()], expected[mask.bool()], atol=1e-6, rtol=1e-6)
        assert len(cached) == len(expected_cached) == 2 * LAYERS
        for got, want in zip(cached, expected_cached):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_auto_fast_paths_are_those_verified_for_every_encoding_of_a_mix():
    mix = ("rope", "alibi")
    for device in (torch.device("cpu"), torch.device("cuda")):
        expected = {path.name for path in PATHS if all(path.verified_for(device.type, name) for name in mix)}
        assert resolve("auto", device, mix) == expected
        assert resolve("auto", device, mix) <= resolve("auto", device, "rope") & resolve("auto", device, "alibi")
    assert "attention-blocks" in resolve("auto", torch.device("cuda"), "alibi")
    assert "attention-blocks" not in resolve("auto", torch.device("cuda"), mix)


def test_tape_updates_its_state_up_to_its_last_layer_in_a_mix():
    """TAPE's last layer in the schedule never updates E (its E would be discarded), wherever that layer is."""
    model = tiny_model("tape", num_hidden_layers=4, layer_pe_types=["tape", "tape", "rope", "nope"])
    assert [bool(list(layer.positional.parameters())) for layer in model.model.layers] == [True, False, False, False]
    assert sum(p.numel() for p in model.tape_parameters()) == sum(
        p.numel() for p in model.model.layers[0].positional.parameters()
    )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"layer_pe_types": ["rope", "nope"]}, "layer_pe_types=['rope', 'nope'] is not allowed; give one of"),
        ({"layer_pe_types": "every-other"}, "layer_pe_types='every-other' is not allowed; choose one of: nope-every"),
        ({"layer_pe_types": ["rope", "nope", "swa"]}, "layer_pe_types[2]='swa' is not allowed; choose one of: tape"),
        ({"layer_pe_types": ["rope", "learned", "rope"]}, "mixes 'learned', which changes the input embeddings"),
        ({"layer_pe_types": ["randpe", "nope", "rope"]}, "mixes 'randpe', which changes the positions of every"),
        ({"pe_type": "sinusoidal", "layer_pe_types": "nope-every-2nd"}, "mixes 'sinusoidal'"),
        (
            {"layer_pe_types": ["rope", "fox", "rope"], "causal": False},
            "causal=False is not allowed with pe_type='fox'",
        ),
        (
            {"pe_type": "rope", "rope_layers": [0], "layer_pe_types": ["rope"] * 3},
            "both schedule the layers; give layer_pe_types only",
        ),
        ({"pe_type": "tape", "rope_fraction": 0.5, "layer_pe_types": ["tape", "nope", "alibi"]}, "rope_fraction=0.5"),
    ],
)
def test_a_bad_schedule_is_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=re.escape(message)) as raised:
        tiny_config(**{"num_hidden_layers": 3, **options})
    assert "\n" not in str(raised.value)


def test_p_rope_applies_to_the_rope_layers_of_a_mix():
    ids = tokens(2, 10)
    mix = tiny_model("nope", dtype=torch.float64, num_hidden_layers=3, layer_pe_types=["rope", "nope", "rope"])
    partly = tiny_model(
        "nope", dtype=torch.float64, num_hidden_layers=3, layer_pe_types=["rope", "nope", "rope"], rope_fraction=0.0
    )
    nope = tiny_model("nope", dtype=torch.float64, num_hidden_layers=3)
    torch.testing.assert_close(partly(ids).logits, nope(ids).logits, atol=1e-12, rtol=0)
    assert not torch.allclose(mix(ids).logits, nope(ids).logits)


def test_a_mixed_cache_holds_one_layer_per_decoder_layer():
    model = scheduled("fox-t5-path-grape")
    cache = DynamicCache(config=model.config)
    model(tokens(2, 7), cache=cache, use_cache=True)
    assert len(cache.layers) == LAYERS and cache.get_seq_length() == 7
