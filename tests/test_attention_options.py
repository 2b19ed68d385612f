"""The attention's options whatever the encoding (`tapelm.attention_options`) and Llama 4's NoPE temperature, each
held to its definition: SSMax as its paper's formula softmax(s log(n) z), n the keys a query sees; the output gate
as the heads' outputs times sigmoid(x W_g) before o_proj; Llama 4's temperature as transformers' Llama4 model
computes it. The user paths (cache, padding, packing, static cache, bf16, save/load) are the conformance kit's laws,
run with the options on."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config, tiny_model, tokens
from tapelm import TapeConfig, TapeForCausalLM
from tapelm.testing import Subject

SOFTMAX_ENCODINGS = ("rope", "tape", "alibi", "fox", "fire", "nope")


def first_layer_probabilities(model, ids, mask=None, position_ids=None) -> torch.Tensor:
    out = model(ids, attention_mask=mask, position_ids=position_ids, output_attentions=True, use_cache=False)
    return out.attentions[0]


def without(model: TapeForCausalLM, **options) -> TapeForCausalLM:
    """The same weights in a model whose config differs by `options` (the options' own tensors left out)."""
    config = TapeConfig(**{**model.config.to_dict(), **options})
    other = TapeForCausalLM(config).to(model.dtype).eval()
    missing, _ = other.load_state_dict(model.state_dict(), strict=False)
    assert not missing
    return other


@pytest.mark.parametrize("pe", SOFTMAX_ENCODINGS)
def test_ssmax_is_softmax_of_the_logits_times_s_log_n(pe):
    """softmax(lambda z) = p^lambda / sum p^lambda for p = softmax(z): the first layer's weights with SSMax are those
    without it raised to s_h log(n_i) and renormalised, n_i the keys query i sees (padding and other documents left
    out), in float64, for a left-padded row, a packed row and a plain one."""
    model = tiny_model(pe, dtype=torch.float64, ssmax=True, std=0.5)
    plain = without(model, ssmax=False)
    scale = model.model.layers[0].self_attn.ssmax.scale.detach()
    ids = tokens(3, 9, seed=1)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    positions = torch.arange(9).repeat(3, 1)
    positions[1, 5:] = torch.arange(4)  # row 1 packs two documents: 5 tokens, then 4
    positions[0] = (mask[0].cumsum(-1) - 1).clamp(min=0)
    keys_seen = torch.stack([mask[0].cumsum(-1) * mask[0] + (1 - mask[0]), positions[1] + 1, positions[2] + 1])
    power = scale[None, :, None, None] * keys_seen.double().log()[:, None, :, None]
    for call in ({"mask": mask}, {"position_ids": positions}):
        rows = [0] if "mask" in call else [1, 2]
        p = first_layer_probabilities(plain, ids, **call)
        expected = torch.where(p > 0, p.clamp(min=1e-300) ** power, 0)
        expected = expected / expected.sum(-1, keepdim=True)
        got = first_layer_probabilities(model, ids, **call)
        torch.testing.assert_close(got[rows], expected[rows], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_the_output_gate_multiplies_the_heads_outputs_by_sigmoid_of_the_attention_input(gate):
    """The gated model equals the ungated one whose o_proj reads its input times sigmoid(x W_g), x the attention's
    input (after the norm): one gate per feature, or per head, broadcast over its features."""
    model = tiny_model("tape", dtype=torch.float64, attention_gate=gate, std=0.5)
    plain = without(model, attention_gate=None)
    ids = tokens(2, 7, seed=2)
    heads, head_dim = model.config.num_attention_heads, model.config.head_dim
    for layer, gated in zip(plain.model.layers, model.model.layers):
        weight = gated.self_attn.output_gate.proj.weight
        seen = {}
        layer.input_layernorm.register_forward_hook(lambda m, args, out, seen=seen: seen.update(x=out))

        def gate_input(module, args, seen=seen, weight=weight):
            values = torch.sigmoid(seen["x"] @ weight.T)
            if values.shape[-1] == heads:
                values = values.repeat_interleave(head_dim, dim=-1)
            return (args[0] * values,)

        layer.self_attn.o_proj.register_forward_pre_hook(gate_input)
    torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(model(ids).logits, without(model, attention_gate=None)(ids).logits)


def test_llama4_temperature_equals_transformers_llama4_nope_layers():
    """A dense Llama 4 of NoPE layers with `attn_temperature_tuning` (transformers' Llama4ForCausalLM) and tapelm's
    NoPE with `nope_temperature_tuning` compute the same logits from the same weights; a floor scale of 3 makes the
    factor change every 3 tokens. Llama 4's RMSNorm rounds to float32, hence the tolerance."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    sizes = dict(
        vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8
    )
    source_config = Llama4TextConfig(
        **sizes,
        intermediate_size=48,
        intermediate_size_mlp=48,
        no_rope_layers=[0, 0],
        moe_layers=[],
        attn_temperature_tuning=True,
        floor_scale=3,
        attn_scale=0.5,
        rms_norm_eps=1e-6,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    source = Llama4ForCausalLM(source_config).double().eval()
    for parameter in source.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    config = TapeConfig(
        **sizes,
        intermediate_size=48,
        pe_type="nope",
        nope_temperature_tuning=True,
        nope_floor_scale=3,
        nope_attn_scale=0.5,
    )
    model = TapeForCausalLM(config).double().eval()
    weights = {name.replace("feed_forward", "mlp"): value for name, value in source.state_dict().items()}
    model.load_state_dict(weights)
    ids = tokens(2, 20, seed=4)
    expected = source(ids).logits
    torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
    untuned = without(model, nope_temperature_tuning=False)(ids).logits
    assert (untuned - expected).abs().max() > 1e-2  # the factor matters at these lengths
    # decoding with a cache continues the factor where the prefix left it
    prefix = model(ids[:, :11], use_cache=True)
    step = model(ids[:, 11:], cache=prefix.cache)
    torch.testing.assert_close(step.logits, expected[:, 11:], rtol=1e-5, atol=1e-5)


KIT_LAWS = ("cache_step", "static_cache", "left_padding", "packed_documents", "relative", "save_load", "bf16_autocast")


@pytest.mark.parametrize(
    ("pe", "options"),
    [
        ("rope", {"ssmax": True, "attention_gate": "elementwise"}),
        ("fox", {"ssmax": True, "attention_gate": "headwise"}),
        ("tape", {"ssmax": True, "attention_gate": "elementwise"}),
        ("rope", {"layer_pe_types": "nope-every-2nd", "nope_temperature_tuning": True, "nope_floor_scale": 3.0}),
    ],
    ids=["rope-ssmax-gate", "fox-ssmax-gate", "tape-ssmax-gate", "rope-nope-temperature"],
)
@pytest.mark.parametrize("law", KIT_LAWS)
def test_the_kits_laws_hold_with_the_options_on(pe, options, law):
    from tapelm.testing import LAWS

    LAWS[law](Subject(pe, options=options))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pe_type": "stickbreaking", "ssmax": True}, "computes its attention itself"),
        ({"pe_type": "wall", "ssmax": True}, "computes its attention itself"),
        ({"pe_type": "rope", "ssmax": 1}, "ssmax=1 is not allowed"),
        ({"pe_type": "rope", "ssmax": True, "ssmax_scale_init": 0}, "ssmax_scale_init=0 is not allowed"),
        ({"pe_type": "rope", "attention_gate": "sigmoid"}, "attention_gate='sigmoid' is not allowed"),
        ({"pe_type": "rope", "nope_temperature_tuning": True}, "an option of NoPE layers"),
        ({"pe_type": "nope", "nope_temperature_tuning": True, "nope_floor_scale": -1}, "nope_floor_scale=-1"),
    ],
)
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**options)


def test_ssmax_scale_starts_at_its_init_and_each_option_adds_only_its_own_tensors():
    base = set(TapeForCausalLM(tiny_config("rope")).state_dict())
    model = TapeForCausalLM(tiny_config("rope", ssmax=True, ssmax_scale_init=0.25, attention_gate="headwise"))
    added = set(model.state_dict()) - base
    assert added == {
        f"model.layers.{i}.self_attn.{name}" for i in range(2) for name in ("ssmax.scale", "output_gate.proj.weight")
    }
    assert torch.equal(model.model.layers[1].self_attn.ssmax.scale, torch.full((4,), 0.25))
    assert model.model.layers[0].self_attn.output_gate.proj.weight.shape == (4, 32)
    nope = TapeForCausalLM(tiny_config("nope", nope_temperature_tuning=True))
    assert set(nope.state_dict()) == set(TapeForCausalLM(tiny_config("nope")).state_dict())


def test_the_report_pairs_each_option_with_its_encoding_by_seed(tmp_path):
    """The "Options of the attention" section: each option row minus the same encoding without it, paired by seed,
    at the training length, beyond it and at the longest length, its verdict read beyond; TAPE minus RoPE with the
    option beside TAPE minus RoPE without it; nothing for a comparison without option rows."""
    import json

    from tapelm.report.options_section import build
    from tapelm.report.sections import ReportContext

    folder = tmp_path / "compare" / "mqar" / "abc"
    folder.mkdir(parents=True)
    (folder / "comparison.json").write_text(json.dumps({"task": "mqar", "settings_hash": "abc"}))
    plain = tmp_path / "compare" / "flipflop" / "old"
    plain.mkdir(parents=True)
    (plain / "comparison.json").write_text(json.dumps({"task": "flipflop", "settings_hash": "old"}))
    beyond = {"rope": 0.10, "tape": 0.40, "rope-gated": 0.20, "tape-gated": 0.45, "rope-ssmax": 0.10}
    for pe, value in beyond.items():
        for seed, noise in enumerate((0.0, 0.01, 0.02)):
            run = folder / pe / f"seed{seed}"
            run.mkdir(parents=True)
            longer = value + (noise if pe.endswith("gated") else 0.0)
            summary = {"in_distribution": 1.0, "longer": longer, "by_length": {"17": 1.0, "257": longer / 2}}
            (run / "result.json").write_text(
                json.dumps({"pe": pe, "seed": seed, "metric": "accuracy", "summary": summary})
            )
            (run / "eval.json").write_text("{}")
    text = build(ReportContext(tmp_path, tmp_path / "figures", "figures", tmp_path / "compare"))
    assert "| mqar (`abc`) | in distribution | beyond (mean) | at the longest | seeds | verdict |" in text
    assert "| rope-gated − rope | +0.0 ± 0.0 | +11.0 ± 2.5 | +5.5 ± 1.2 | 3 | better |" in text
    assert "| rope-ssmax − rope | +0.0 ± 0.0 | +0.0 ± 0.0 | +0.0 ± 0.0 | 3 | no difference shown |" in text
    assert "| tape-gated − rope-gated | +0.0 ± 0.0 | +25.0 ± 0.0 | +12.5 ± 0.0 | 3 | better |" in text
    assert "| tape − rope (no option) | +0.0 ± 0.0 | +30.0 ± 0.0 | +15.0 ± 0.0 | 3 | better |" in text
    assert "tape-ssmax" not in text and "flipflop" not in text
    assert build(ReportContext(tmp_path, tmp_path / "f", "f", tmp_path / "nothing")) is None
