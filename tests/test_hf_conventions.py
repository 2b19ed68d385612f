"""transformers conventions a Llama obeys and tapelm must too: tuples with return_dict=False, the config's output
flags, returned hidden states and attentions on the gradient path, meta-device initialisation, and every positional
tensor given its defined value by transformers' initialisation (also when a checkpoint lacks it)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_config, tiny_model, tokens
from tapelm import PE_TYPES, TapeForCausalLM

# Encodings whose parameters live in a child module of the positional module, or whose initial value is an option.
VARIANTS = [(pe, {}) for pe in PE_TYPES] + [
    ("fire", {"fire_shared": True}),
    ("t5", {"t5_shared": True}),
    ("fox", {"fox_gate_bias_init": 2.0}),
    ("pope", {"pope_shared_bias": True, "pope_bias_init": "uniform"}),
    ("rope", {"ssmax": True, "ssmax_scale_init": 0.3, "attention_gate": "elementwise"}),
    ("alibi", {"ssmax": True, "attention_gate": "headwise"}),
    ("nope", {"nope_temperature_tuning": True, "nope_floor_scale": 2.0}),
    ("tape", {"num_hidden_layers": 4, "layer_pe_types": ["tape", "fire", "t5", "tape"]}),
    (
        "rope",
        {"num_hidden_layers": 3, "layer_pe_types": ["fire", "t5", "rope"], "fire_shared": True, "t5_shared": True},
    ),
]
VARIANT_IDS = [pe + "".join(f"-{k}={v}" for k, v in options.items()) for pe, options in VARIANTS]


def padded_batch():
    ids = tokens(2, 7, seed=3)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids, mask


def test_return_dict_false_gives_the_tuple_llama_gives():
    model, ids = tiny_model("tape"), tokens(2, 6)
    full = model(ids, labels=ids)
    loss, logits, cache = model(ids, labels=ids, return_dict=False)
    assert torch.equal(loss, full.loss) and torch.equal(logits, full.logits) and cache.get_seq_length() == 6
    loss, logits = model(ids, labels=ids, use_cache=False, return_dict=False)
    assert torch.equal(loss, full.loss)
    (hidden,) = model.model(ids, use_cache=False, return_dict=False)
    assert torch.equal(model.lm_head(hidden), full.logits)


def test_config_return_dict_false_gives_tuples_and_the_kwarg_wins():
    model, ids = tiny_model("rope", return_dict=False), tokens(2, 6)
    out = model(ids, use_cache=False)
    assert isinstance(out, tuple) and len(out) == 1
    assert isinstance(model.model(ids, use_cache=False), tuple)
    assert torch.equal(model(ids, use_cache=False, return_dict=True).logits, out[0])


def test_config_output_hidden_states_is_honoured_and_the_kwarg_wins():
    model, ids = tiny_model("tape", output_hidden_states=True), tokens(2, 6)
    hidden = model(ids).hidden_states
    assert len(hidden) == model.config.num_hidden_layers + 1
    assert model(ids, output_hidden_states=False).hidden_states is None
    model.config.output_hidden_states = False
    assert model(ids).hidden_states is None


def test_returned_hidden_states_and_attentions_are_on_the_gradient_path(pe_type):
    """In a padded batch too, as in Llama: each returned tensor is the one the rest of the pass reads, so a gradient
    reaches it (retain_grad) at the real tokens; the last hidden state is `last_hidden_state` itself."""
    model = tiny_model(pe_type).train()
    ids, mask = padded_batch()
    out = model.model(ids, attention_mask=mask, use_cache=False, output_hidden_states=True, output_attentions=True)
    assert out.hidden_states[-1] is out.last_hidden_state
    for tensor in out.hidden_states + out.attentions:
        tensor.retain_grad()
    model.lm_head(out.last_hidden_state).logsumexp(-1)[mask.bool()].sum().backward()
    for i, hidden in enumerate(out.hidden_states):
        assert hidden.grad is not None, f"hidden state {i} is off the gradient path"
        assert hidden.grad[mask.bool()].abs().sum() > 0
        assert not hidden.grad[~mask.bool()].any()
    for i, probs in enumerate(out.attentions):
        assert probs.grad is not None, f"attention map {i} is off the gradient path"
        assert probs.grad.abs().sum() > 0


def test_hidden_states_requested_change_nothing_else(pe_type):
    model = tiny_model(pe_type).train()
    ids, mask = padded_batch()
    torch.manual_seed(0)  # RandPE draws its positions in training
    plain = model(ids, attention_mask=mask, labels=ids, use_cache=False)
    plain.loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.manual_seed(0)
    traced = model(ids, attention_mask=mask, labels=ids, use_cache=False, output_hidden_states=True)
    traced.loss.backward()
    assert torch.equal(traced.logits, plain.logits)
    for p, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-7)


def deterministic(config) -> dict[str, torch.Tensor]:
    """The tensors of a fresh model that do not depend on the seed (constants, tables), by name."""
    torch.manual_seed(0)
    a = TapeForCausalLM(config).state_dict(keep_vars=False) | dict(TapeForCausalLM(config).named_buffers())
    torch.manual_seed(1)
    b = TapeForCausalLM(config).state_dict(keep_vars=False) | dict(TapeForCausalLM(config).named_buffers())
    return {name: a[name] for name in a if torch.equal(a[name], b[name])}


def meta_initialised(config, fill: float | None = None) -> TapeForCausalLM:
    """Built on the meta device, materialised with `to_empty` (optionally filled with `fill`), then initialised
    as FSDP2-style sharded initialisation does."""
    with torch.device("meta"):
        model = TapeForCausalLM(config)
    model.to_empty(device="cpu")
    if fill is not None:
        with torch.no_grad():
            for tensor in list(model.parameters()) + list(model.buffers()):
                tensor.fill_(fill)
    model.init_weights()
    return model


@pytest.mark.parametrize(("pe", "options"), VARIANTS, ids=VARIANT_IDS)
def test_meta_device_initialisation_equals_a_normal_one(pe, options):
    config = tiny_config(pe, **options)
    model = meta_initialised(config, fill=float("nan"))
    expected = deterministic(config)
    values = model.state_dict() | dict(model.named_buffers())
    assert (
        values.keys() == (TapeForCausalLM(config).state_dict() | dict(TapeForCausalLM(config).named_buffers())).keys()
    )
    for name, value in values.items():
        assert torch.isfinite(value).all(), f"{name} was not initialised"
        if name in expected:
            assert torch.equal(value, expected[name]), f"{name} differs from a normally built model's"
    torch.manual_seed(0)
    reference = tiny_model(pe, **options)
    model.load_state_dict(reference.state_dict())
    ids, mask = padded_batch()
    torch.testing.assert_close(
        model.eval()(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits, rtol=0, atol=0
    )


@pytest.mark.parametrize(("pe", "options"), VARIANTS, ids=VARIANT_IDS)
def test_checkpoint_without_positional_tensors_loads_their_initial_values(pe, options, tmp_path):
    """transformers initialises only the modules whose tensors a checkpoint lacks: every positional tensor must be
    set by the module that owns it (FIRE's c and threshold multiplier used to keep uninitialised memory)."""
    config = tiny_config(pe, **options)
    tiny_model(pe, **options).save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(path)
    save_file({k: v for k, v in state.items() if ".positional." not in k}, path, metadata={"format": "pt"})
    loaded = TapeForCausalLM.from_pretrained(tmp_path)
    values = loaded.state_dict() | dict(loaded.named_buffers())
    for name, value in deterministic(config).items():
        if ".positional." in name:
            assert torch.equal(values[name], value), f"{name} was not given its initial value"


def test_fox_gate_bias_starts_at_its_option():
    """The forget gate's bias option used to be overwritten by the Linear default (0) in every fresh model."""
    model = TapeForCausalLM(tiny_config("fox", fox_gate_bias_init=2.0))
    for layer in model.model.layers:
        assert torch.equal(layer.positional.gate.bias, torch.full((4,), 2.0))


def test_meta_initialisation_in_bfloat16_keeps_float32_rotary_tables():
    config = tiny_config("tape")
    with torch.device("meta"):
        model = TapeForCausalLM(config).to(torch.bfloat16)
    model.to_empty(device="cpu")
    model.init_weights()
    expected = dict(TapeForCausalLM(config).to(torch.bfloat16).named_buffers())
    for name, buffer in model.named_buffers():
        assert buffer.dtype == torch.float32 and torch.equal(buffer, expected[name]), name
