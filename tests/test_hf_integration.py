"""Auto classes, safetensors round trips and TAPE's own parameters."""

import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import tapelm
from conftest import tiny_config, tiny_model, tokens
from tapelm import TapeForCausalLM, TapeModel


def test_a_saved_folder_is_safetensors_and_loads_through_every_auto_class(tmp_path):
    """(Equal logits after a round trip: `tapelm.testing.law_save_load`, for every encoding.)"""
    tiny_model("tape").save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert AutoConfig.from_pretrained(tmp_path).pe_type == "tape"
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path), TapeForCausalLM)
    assert isinstance(AutoModel.from_pretrained(tmp_path), TapeModel)


def test_tied_embeddings_round_trip(tmp_path):
    model = tiny_model("tape", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = tokens(1, 10)
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_tape_parameters_are_exactly_what_tape_adds():
    config = tiny_config("tape", num_hidden_layers=3)
    tape, rope = TapeForCausalLM(config), TapeForCausalLM(tiny_config("rope", num_hidden_layers=3))
    heads, kv, hidden, size = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.hidden_size,
        config.tape_position_size,
    )
    per_layer = kv * heads + hidden * size + size * kv + kv * size  # W_att, W_x, W_up, W_down
    added = sum(p.numel() for p in tape.tape_parameters())
    assert added == per_layer * (config.num_hidden_layers - 1)  # the last layer's E is discarded
    assert added == tape.num_parameters() - rope.num_parameters()
    tape_ids = {id(p) for p in tape.tape_parameters()}
    rope_names = {n for n, _ in rope.named_parameters()}
    assert {n for n, p in tape.named_parameters() if id(p) not in tape_ids} == rope_names
    assert list(rope.tape_parameters()) == []


def test_fresh_tape_zero_inits_survive_post_init():
    model = TapeForCausalLM(tiny_config("tape"))
    layer = model.model.layers[0].positional
    assert torch.count_nonzero(layer.attn_mix) == 0 and torch.count_nonzero(layer.mix_up) == 0
    assert layer.mix_down.std() > 0 and layer.gate.weight.std() > 0


def test_package_registers_auto_classes():
    config = AutoConfig.for_model(
        "tape", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    assert isinstance(AutoModelForCausalLM.from_config(config), TapeForCausalLM)
    assert tapelm.__version__


def test_set_attn_implementation_switches_the_attention_path():
    """transformers' runtime switch works: after `set_attn_implementation("eager")` a model computes exactly what the
    same weights compute when built eager (tapelm reads the choice at every call), and "sdpa" switches back."""
    ids = tokens(2, 9)
    model = tiny_model("tape")
    eager = TapeForCausalLM(tiny_config("tape", attn_implementation="eager")).eval()
    eager.load_state_dict(model.state_dict())
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    torch.testing.assert_close(model(ids).logits, eager(ids).logits, atol=0, rtol=0)
    model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa"


def test_hub_kernels_can_replace_only_modules_tapelm_never_runs(pe_type):
    """transformers (from 5.25, by default) replaces the forward of every hub-kernel layer (a class with a
    `kernel_layer_name`) when a loaded model moves to a GPU; none of those may be a module the forward pass calls."""
    model = tiny_model(pe_type)
    replaceable = [(name, m) for name, m in model.named_modules() if hasattr(type(m), "kernel_layer_name")]
    called = []
    for name, module in replaceable:
        module.register_forward_hook(lambda *_, name=name: called.append(name))
    model(tokens(1, 8))
    assert called == []


def test_a_loaded_model_keeps_hub_kernels_off(tmp_path):
    from tapelm.training.saved_models import load_saved_model

    tiny_model("tape").save_pretrained(tmp_path)
    loaded = load_saved_model(tmp_path, TapeForCausalLM)
    assert not loaded.use_kernels
    loaded.to("meta").train()  # with hub kernels on, transformers would kernelize here and refuse the meta device
