"""p-RoPE (Barbero et al., ICLR 2025), RoPE's `rope_fraction` option: only the highest frequencies rotate. Its limits
are RoPE (p = 1) and NoPE (p = 0); in between, the dropped pairs pass through unrotated, and attention still depends
on relative positions only."""

import pytest
import torch

from conftest import DEVICE, decode_in_chunks, tiny_model, tokens
from tapelm import TapeConfig

pytestmark = pytest.mark.device


def p_rope(fraction: float, **overrides):
    return tiny_model("rope", dtype=torch.float64, rope_fraction=fraction, **overrides)


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


def test_attention_depends_on_relative_positions_only():
    model, ids = p_rope(0.5), tokens(2, 12)
    positions = torch.arange(12, device=DEVICE).expand(2, -1)
    torch.testing.assert_close(
        model(ids, position_ids=positions + 37).logits, model(ids, position_ids=positions).logits, atol=1e-10, rtol=0
    )


def test_a_cache_decodes_as_the_whole_pass():
    model, ids = p_rope(0.5), tokens(2, 12)
    torch.testing.assert_close(decode_in_chunks(model, ids, (5, 1, 1, 5)), model(ids).logits, atol=1e-10, rtol=0)


def test_the_fraction_survives_save_and_load(tmp_path):
    from transformers import AutoModelForCausalLM

    model, ids = p_rope(0.25), tokens(1, 9)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).to(DEVICE)
    assert loaded.config.rope_fraction == 0.25
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-10, rtol=0)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"pe_type": "rope", "rope_fraction": 1.5}, "rope_fraction=1.5 is not allowed; give the share"),
        ({"pe_type": "rope", "rope_fraction": True}, "rope_fraction=True is not allowed"),
        ({"pe_type": "tape", "rope_fraction": 0.5}, "rope_fraction=0.5 is an option of pe_type='rope'"),
    ],
)
def test_a_bad_fraction_is_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        TapeConfig(vocab_size=61, hidden_size=32, num_attention_heads=4, **options)


def test_a_p_rope_model_does_not_convert_to_llama():
    from tapelm.pretrained.convert import to_llama

    with pytest.raises(ValueError, match="only rope_fraction=1 converts to Llama"):
        to_llama(p_rope(0.5))
