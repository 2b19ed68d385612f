"""RoPE's options that make it partly NoPE. p-RoPE (Barbero et al., ICLR 2025), `rope_fraction`: only the highest
frequencies rotate; its limits are RoPE (p = 1) and NoPE (p = 0), in between the dropped pairs pass through unrotated.
`rope_layers`: NoPE in the layers the schedule leaves out (SmolLM3's every fourth); a layer's output is the RoPE or
the NoPE model's layer's. Either way attention depends on relative positions only, and a cache decodes exactly."""

import re

import pytest
import torch

from conftest import DEVICE, decode_in_chunks, new_model, tiny_model, tokens
from tapelm import TapeConfig

pytestmark = pytest.mark.device


def p_rope(fraction: float, **overrides):
    return tiny_model("rope", dtype=torch.float64, rope_fraction=fraction, **overrides)


def scheduled(layers, **overrides):
    return tiny_model("rope", dtype=torch.float64, num_hidden_layers=4, rope_layers=layers, **overrides)


def test_the_whole_fraction_is_rope_and_none_is_nope():
    ids = tokens(2, 12)
    rope, nope = tiny_model("rope", dtype=torch.float64), tiny_model("nope", dtype=torch.float64)
    assert torch.equal(p_rope(1.0)(ids).logits, rope(ids).logits)
    torch.testing.assert_close(p_rope(0.0)(ids).logits, nope(ids).logits, atol=1e-12, rtol=0)
    assert not torch.allclose(p_rope(0.5)(ids).logits, rope(ids).logits)


@pytest.mark.parametrize("fraction, rotating", [(0.25, 1), (0.5, 2), (0.75, 3)])
def test_only_the_highest_frequencies_rotate(fraction, rotating):
    """head_dim 8: four pairs; the tables of p-RoPE are RoPE's for the `rotating` highest frequencies (the first
    pairs) and the identity (cos 1, sin 0) for the others."""
    positions = torch.arange(10, device=DEVICE)[None]
    cos, sin = p_rope(fraction).model.positional.rotary.tables(positions, torch.float64)
    full_cos, full_sin = tiny_model("rope", dtype=torch.float64).model.positional.rotary.tables(
        positions, torch.float64
    )
    assert torch.equal(cos[..., :rotating], full_cos[..., :rotating])
    assert torch.equal(sin[..., :rotating], full_sin[..., :rotating])
    assert torch.equal(cos[..., rotating:], torch.ones_like(cos[..., rotating:]))
    assert torch.equal(sin[..., rotating:], torch.zeros_like(sin[..., rotating:]))


@pytest.mark.parametrize("head_dim", [8, 16, 20, 64])
@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.25, 0.3, 0.45, 0.5, 0.6, 0.75, 0.9, 1.0])
def test_p_rope_rotates_what_transformers_proportional_rope_rotates(fraction, head_dim):
    """`rope_fraction` p counts its rotating pairs as transformers' `rope_type="proportional"` with
    `partial_rotary_factor` p does (floor(p x head_dim / 2): the two rules differ from rounding at p = 0.45 with
    head_dim 16, 3 pairs against 4), and rotates them by the same frequencies: transformers' own function gives the
    spectrum, zeros for the pairs that do not rotate."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = TapeConfig(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        head_dim=head_dim,
        pe_type="rope",
        rope_fraction=fraction,
        rope_parameters={"rope_type": "proportional", "rope_theta": 500.0, "partial_rotary_factor": fraction},
    )
    expected, _ = ROPE_INIT_FUNCTIONS["proportional"](config, DEVICE)
    default = TapeConfig(**{**config.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}})
    rotary = new_model(default).model.positional.rotary
    frequencies = rotary.inv_freq * (torch.arange(head_dim // 2, device=DEVICE) < rotary.rotating_pairs)
    assert torch.equal(frequencies, expected)


def test_a_p_rope_model_computes_the_proportional_rope_model():
    """The same weights under `rope_fraction` p and under transformers' proportional RoPE with p: the same logits."""
    ids = tokens(2, 12)
    model = p_rope(0.75)
    proportional = tiny_model(
        "rope",
        dtype=torch.float64,
        rope_parameters={"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
    )
    proportional.load_state_dict(model.state_dict())
    torch.testing.assert_close(proportional(ids).logits, model(ids).logits, atol=1e-12, rtol=0)


@pytest.mark.parametrize("layers, rotating", [("all", [0, 1, 2, 3]), ("nope-every-4th", [0, 1, 2]), ([1, 3], [1, 3])])
def test_each_layer_is_the_rope_or_the_nope_models_layer(layers, rotating):
    """Given the same weights, layer i's output from the same input is the RoPE model's where i rotates, the NoPE
    model's elsewhere: the schedule changes nothing but which layers rotate."""
    ids = tokens(2, 12)
    model = scheduled(layers)
    rope, nope = (
        tiny_model("rope", dtype=torch.float64, num_hidden_layers=4),
        tiny_model("nope", dtype=torch.float64, num_hidden_layers=4),
    )
    for other in (rope, nope):
        other.load_state_dict(model.state_dict(), strict=False)
    states = model(ids, output_hidden_states=True).hidden_states
    for i in range(4):
        reference = (rope if i in rotating else nope).model.layers[i]
        alone = model.model.layers[i]
        expected = run_layer(reference, rope if i in rotating else nope, states[i], ids)
        torch.testing.assert_close(run_layer(alone, model, states[i], ids), expected, atol=1e-12, rtol=0)


def run_layer(layer, model, hidden, ids):
    """`layer` of `model` on hidden states `hidden` (the model's own positions and causal mask)."""
    outputs = {}
    handle = layer.register_forward_hook(lambda module, args, output: outputs.setdefault("out", output))
    pre = layer.register_forward_pre_hook(lambda module, args, kwargs: ((hidden, *args[1:]), kwargs), with_kwargs=True)
    try:
        model(ids)
    finally:
        handle.remove()
        pre.remove()
    out = outputs["out"]
    return out[0] if isinstance(out, tuple) else out


def test_no_rotating_layer_is_nope():
    ids = tokens(2, 12)
    torch.testing.assert_close(
        scheduled([])(ids).logits,
        tiny_model("nope", dtype=torch.float64, num_hidden_layers=4)(ids).logits,
        atol=1e-12,
        rtol=0,
    )


def test_attention_depends_on_relative_positions_only():
    model, ids = p_rope(0.5), tokens(2, 12)
    positions = torch.arange(12, device=DEVICE).expand(2, -1)
    torch.testing.assert_close(
        model(ids, position_ids=positions + 37).logits, model(ids, position_ids=positions).logits, atol=1e-10, rtol=0
    )


@pytest.mark.parametrize("options", [{"rope_fraction": 0.5}, {"rope_layers": "nope-every-4th", "num_hidden_layers": 4}])
def test_a_cache_decodes_as_the_whole_pass(options):
    model, ids = tiny_model("rope", dtype=torch.float64, **options), tokens(2, 12)
    torch.testing.assert_close(decode_in_chunks(model, ids, (5, 1, 1, 5)), model(ids).logits, atol=1e-10, rtol=0)
    positions = torch.arange(12, device=DEVICE).expand(2, -1)
    torch.testing.assert_close(
        model(ids, position_ids=positions + 37).logits, model(ids, position_ids=positions).logits, atol=1e-10, rtol=0
    )


def test_the_options_survive_save_and_load(tmp_path):
    from transformers import AutoModelForCausalLM

    model, ids = p_rope(0.25, num_hidden_layers=4, rope_layers=[0, 3]), tokens(1, 9)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).to(DEVICE)
    assert loaded.config.rope_fraction == 0.25 and list(loaded.config.rope_layers) == [0, 3]
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-10, rtol=0)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"pe_type": "rope", "rope_fraction": 1.5}, "rope_fraction=1.5 is not allowed; give the share"),
        ({"pe_type": "rope", "rope_fraction": True}, "rope_fraction=True is not allowed"),
        ({"pe_type": "tape", "rope_fraction": 0.5}, "rope_fraction=0.5 is an option of pe_type='rope'"),
        ({"pe_type": "rope", "rope_layers": "some"}, "rope_layers='some' is not allowed; choose one of: all"),
        ({"pe_type": "rope", "rope_layers": [0, 2]}, "rope_layers=[0, 2] is not allowed; give one of"),
        ({"pe_type": "rope", "rope_layers": [1, 1]}, "rope_layers=[1, 1] is not allowed"),
        ({"pe_type": "tape", "rope_layers": [0]}, "rope_layers=[0] is an option of pe_type='rope'"),
        (  # a scaling an encoding would silently ignore
            {"pe_type": "alibi", "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            "rope_type='linear' is not allowed with pe_type='alibi': no layer reads RoPE's frequencies",
        ),
    ],
)
def test_a_bad_option_is_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TapeConfig(vocab_size=61, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, **options)


def test_a_partly_nope_model_does_not_convert_to_llama():
    from tapelm.conversion import to_llama

    with pytest.raises(ValueError, match="only rope_fraction=1 converts to Llama"):
        to_llama(p_rope(0.5))
    with pytest.raises(ValueError, match="only a model whose every layer is RoPE converts"):
        to_llama(scheduled([0, 1]))
