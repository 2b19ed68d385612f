"""Conversion of pretrained Llama-family models to tapelm: exact logits at step 0, clear refusals, round trips."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

import tapelm
from conftest import DEVICE
from tapelm import TapeForCausalLM
from tapelm.cli import main as cli_main
from tapelm.conversion import from_pretrained_llama, to_llama
from tapelm.pretrained import sources

pytestmark = pytest.mark.device

SIZES = dict(
    vocab_size=53,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=6,
    max_position_embeddings=256,
)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM),
}


def random_source(family: str, kv_heads: int = 2, tied: bool = False, **extra) -> torch.nn.Module:
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = model_cls(config_cls(**SIZES, num_key_value_heads=kv_heads, tie_word_embeddings=tied, **extra))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # large random weights (biases included) so that every weight matters to the logits
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, device="cpu").to(DEVICE)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)
    return model.eval()


def ids(length: int = 40, batch: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(2)
    return torch.randint(0, SIZES["vocab_size"], (batch, length), generator=generator, device="cpu").to(DEVICE)


@pytest.mark.parametrize("pe_type", ["tape", "rope"])
@pytest.mark.parametrize(
    "family,kv_heads,tied,extra",
    [
        ("llama", 2, True, {"attention_bias": True}),
        ("llama", 6, False, {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}}),
        (  # transformers' p-RoPE (Gemma 4's full-attention layers): the same rotation as tapelm's rope_fraction
            "llama",
            2,
            False,
            {"rope_parameters": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e4}},
        ),
        (
            "llama",
            3,
            False,
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "rope_theta": 1e4,
                    "original_max_position_embeddings": 16,
                }
            },
        ),
        ("mistral", 2, False, {"sliding_window": None}),
        ("mistral", 3, True, {"sliding_window": None, "head_dim": 16}),
        ("qwen2", 2, False, {}),
        ("smollm3", 2, True, {"no_rope_layer_interval": 2, "pad_token_id": None}),  # NoPE layers: layer_pe_types
        ("smollm3", 3, False, {"no_rope_layers": [0, 1, 1], "pad_token_id": None, "attention_bias": True}),
        (
            "qwen2",
            3,
            True,
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "rope_theta": 1e4,
                    "original_max_position_embeddings": 16,
                }
            },
        ),
    ],
)
def test_converted_logits_equal_the_source(family, kv_heads, tied, extra, pe_type):
    source = random_source(family, kv_heads, tied, **extra)
    model = from_pretrained_llama(source, pe_type=pe_type)
    assert isinstance(model, TapeForCausalLM) and not model.training
    assert model.config.pe_type == pe_type and model.config.tie_word_embeddings == tied
    assert model.config.num_key_value_heads == kv_heads
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tokens = ids()
    with torch.no_grad():
        expected = source(tokens).logits
        torch.testing.assert_close(model(tokens).logits, expected, atol=1e-4, rtol=0)
    if pe_type == "tape":  # TAPE's own parameters exist and are left at their (exact) initialisation
        assert sum(p.numel() for p in model.tape_parameters()) > 0


@pytest.mark.device
@pytest.mark.parametrize(
    "family,kv_heads,tied,extra",
    [
        ("llama", 2, True, {"attention_bias": True}),
        ("mistral", 3, True, {"sliding_window": None, "head_dim": 16}),
        ("qwen2", 2, False, {}),
    ],
)
def test_grape_m_fixed_converts_exactly_at_step_0(family, kv_heads, tied, extra):
    """GRAPE-M's frequencies start at the source's RoPE spectrum: the converted model computes the RoPE conversion's
    logits to the last bit, and the source's; a scaled RoPE is refused (its frequencies start at the default one)."""
    source = random_source(family, kv_heads, tied, **extra)
    model = from_pretrained_llama(source, pe_type="grape-m-fixed")
    assert all(p.requires_grad and not p.any() for n, p in model.named_parameters() if "log_freq_shift" in n)
    tokens = ids()
    with torch.no_grad():
        logits = model(tokens).logits
        assert torch.equal(logits, from_pretrained_llama(source, pe_type="rope")(tokens).logits)
        torch.testing.assert_close(logits, source(tokens).logits, atol=1e-4, rtol=0)
    scaled = random_source("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0})
    with pytest.raises(ValueError, match="rope_type='linear' is not allowed with pe_type='grape-m-fixed'"):
        from_pretrained_llama(scaled, pe_type="grape-m-fixed")


@pytest.mark.parametrize("pe_type", ["rope", "tape"])
def test_a_context_extension_provably_changes_the_rotation_or_is_refused(pe_type):
    """Every change of `rope_parameters` a conversion makes (what `tapelm finetune`'s theta, pi and yarn and `tapelm
    extend`'s rows ask for) must change the rotation the converted model applies within four times the source's
    window, as transformers' rotary module computes it in a forward pass; one that leaves it as it was is refused in
    one line instead of extending nothing. No change of the parameters, no change of the rotation."""
    from tapelm.conversion import rotation_tables

    source = random_source("llama")
    window = source.config.max_position_embeddings
    positions = torch.arange(4 * window, device=DEVICE)  # dynamic scaling acts beyond the window only
    plain = rotation_tables(from_pretrained_llama(source, pe_type=pe_type), positions)
    assert all(torch.equal(a, b) for a, b in zip(plain, rotation_tables(source, positions)))
    for overrides in (
        {"rope_theta": 5e5},
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": window},
        {"rope_type": "dynamic", "factor": 2.0},
    ):
        extended = rotation_tables(from_pretrained_llama(source, pe_type=pe_type, rope_overrides=overrides), positions)
        assert not all(torch.equal(a, b) for a, b in zip(plain, extended)), overrides
    with pytest.raises(ValueError, match="leave the rotation unchanged at positions 0 to .* extends nothing"):
        from_pretrained_llama(source, pe_type=pe_type, rope_overrides={"rope_type": "linear", "factor": 1.0})


def test_qwen2_biases_are_copied_and_there_is_no_output_bias():
    source = random_source("qwen2")
    model = from_pretrained_llama(source)
    layer, theirs = model.model.layers[1].self_attn, source.model.layers[1].self_attn
    torch.testing.assert_close(layer.q_proj.bias, theirs.q_proj.bias, atol=0, rtol=0)
    torch.testing.assert_close(layer.v_proj.bias, theirs.v_proj.bias, atol=0, rtol=0)
    assert theirs.o_proj.bias is None and layer.o_proj.bias is None


def test_converted_model_decodes_with_its_cache_like_the_source():
    source = random_source("llama", 2, True)
    model = from_pretrained_llama(source)
    prompt = ids(12, 1)
    ours = model.generate(prompt, max_new_tokens=10, do_sample=False)
    theirs = source.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(ours, theirs)


def test_mistral_sliding_window_is_named_and_exact_within_the_window(caplog):
    source = random_source("mistral", 2, False, sliding_window=32)
    with caplog.at_level(logging.WARNING, logger="tapelm.conversion"):
        model = from_pretrained_llama(source)
    assert "sliding_window=32" in caplog.text
    tokens = ids(32)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, source(tokens).logits, atol=1e-4, rtol=0)
        longer = ids(48)
        assert not torch.allclose(model(longer).logits[:, -1], source(longer).logits[:, -1], atol=1e-4)


def test_unknown_architecture_is_refused_with_the_supported_list():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=20))
    with pytest.raises(
        ValueError,
        match=r"'gpt2'.*supported: LlamaForCausalLM \(llama\), MistralForCausalLM "
        r"\(mistral\), Qwen2ForCausalLM \(qwen2\)",
    ):
        from_pretrained_llama(gpt2)


def test_a_model_without_rope_is_refused():
    source = random_source("llama")
    source.config.rope_parameters = None
    with pytest.raises(ValueError, match="without RoPE"):
        from_pretrained_llama(source)


def test_sizes_cannot_be_overridden_and_pe_type_is_checked():
    source = random_source("llama")
    with pytest.raises(ValueError, match="hidden_size come from the source checkpoint"):
        from_pretrained_llama(source, hidden_size=64)
    with pytest.raises(
        ValueError, match="pe_type='alibi' cannot be converted exactly; choose one of: tape, rope, grape-m-fixed"
    ):
        from_pretrained_llama(source, pe_type="alibi")


def test_rope_overrides_change_the_positions_only():
    source = random_source("llama")
    model = from_pretrained_llama(source, pe_type="rope", rope_overrides={"rope_theta": 1e6})
    assert model.config.rope_parameters["rope_theta"] == 1e6
    with torch.no_grad():
        assert not torch.allclose(model(ids()).logits, source(ids()).logits, atol=1e-3)


@pytest.mark.parametrize("tied", [False, True])
def test_a_rope_model_exports_to_llama_exactly_and_back(tied):
    """Llama -> tapelm RoPE -> Llama is the identity on logits (float64), with the stated window; TAPE is refused."""
    source = random_source("llama", tied=tied).double()
    rope = from_pretrained_llama(source, pe_type="rope")
    llama = to_llama(rope, max_position_embeddings=16)
    assert type(llama).__name__ == "LlamaForCausalLM" and llama.config.max_position_embeddings == 16
    torch.testing.assert_close(llama(ids()).logits, source(ids()).logits, atol=0, rtol=0)
    torch.testing.assert_close(
        from_pretrained_llama(llama, pe_type="rope")(ids()).logits, rope(ids()).logits, atol=0, rtol=0
    )
    with pytest.raises(ValueError, match="only a causal RoPE model"):
        to_llama(from_pretrained_llama(source, pe_type="tape"))


def save_with_tokenizer(model: torch.nn.Module, folder: Path) -> None:
    vocab = {f"w{i}": i for i in range(SIZES["vocab_size"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", bos_token="w1", eos_token="w2")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.mark.parametrize(
    "family, extra", [("qwen2", {}), ("smollm3", {"no_rope_layer_interval": 2, "pad_token_id": None})]
)
def test_convert_command_round_trip_through_auto_classes(family, extra, tmp_path: Path):
    source = random_source(family, 3, True, **extra)
    save_with_tokenizer(source, tmp_path / "src")
    assert cli_main(["convert", str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").to(DEVICE).eval()
    assert isinstance(loaded, tapelm.TapeForCausalLM) and loaded.config.pe_type == "tape"
    assert (tmp_path / "dst" / "tokenizer.json").is_file()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids()).logits, source(ids()).logits, atol=1e-4, rtol=0)


def test_convert_command_reports_an_unsupported_checkpoint(tmp_path: Path, capsys):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=20)).save_pretrained(tmp_path / "gpt2")
    assert cli_main(["convert", str(tmp_path / "gpt2"), str(tmp_path / "dst")]) == 2
    assert "supports: llama, mistral, qwen2, smollm3" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(
    not sources.is_available("smollm2-135m"),
    reason="SmolLM2 is not fetched (python -m tapelm.pretrained.sources smollm2-135m)",
)
def test_smollm2_converts_exactly():
    source, tokenizer = sources.load_pretrained("smollm2-135m")
    source.to(DEVICE)
    model = from_pretrained_llama(source)
    text = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n' * 4
    tokens = torch.tensor([tokenizer(text)["input_ids"]], device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, source(tokens).logits, atol=1e-4, rtol=0)
    assert model.config.num_key_value_heads == 3 and model.config.tie_word_embeddings
    assert model.config.rope_parameters["rope_theta"] == 1e5 and model.config.max_position_embeddings == 8192
