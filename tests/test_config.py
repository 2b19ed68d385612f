"""Every invalid field or combination raises ValueError naming it, at construction."""

import pytest

from tapelm import TapeConfig

VALID = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(pe_type="rotary"), "pe_type"),
        (dict(hidden_size=30), "hidden_size"),
        (dict(num_key_value_heads=3), "num_attention_heads"),
        (dict(head_dim=7, pe_type="rope"), "head_dim"),
        (dict(head_dim=7, pe_type="tape"), "head_dim"),
        (dict(tape_block=(3, 3)), "tape_block L"),
        (dict(tape_block=(4, 4), head_dim=6), "tape_block L"),
        (dict(tape_block=(2, 3)), "tape_block R"),
        (dict(tape_block=(2,)), "tape_block"),
        (dict(tape_block=(0, 2)), "tape_block L"),
        (dict(tape_attn_mixing="full"), "tape_attn_mixing"),
        (dict(tape_update="all"), "tape_update"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(hidden_size=-32), "hidden_size"),
        (dict(num_hidden_layers=0), "num_hidden_layers"),
        (dict(intermediate_size=0), "intermediate_size"),
        (dict(max_position_embeddings=0), "max_position_embeddings"),
        (dict(tape_position_size=0), "tape_position_size"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(randpe_max_position=16, max_position_embeddings=32), "randpe_max_position"),
        (dict(num_attention_heads=0), "num_attention_heads"),
    ],
)
def test_invalid_field_is_named(overrides, field):
    with pytest.raises(ValueError, match=field):
        TapeConfig(**{**VALID, **overrides})


def test_defaults_follow_the_method():
    config = TapeConfig(**VALID)
    assert config.pe_type == "tape" and config.tape_block == (2, 2)
    assert config.tape_position_size == 4 * config.num_attention_heads
    assert config.tape_attn_mixing == "heads" and config.tape_update == "both" and config.tape_equivariant
    assert config.causal and config.num_key_value_heads == config.num_attention_heads
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert config.randpe_max_position == 2 * config.max_position_embeddings


def test_odd_head_dim_is_fine_without_rotation():
    assert TapeConfig(**{**VALID, "head_dim": 7, "pe_type": "alibi"}).head_dim == 7


def test_dict_round_trip():
    config = TapeConfig(
        **VALID,
        tape_block=(2, 4),
        pe_type="tape",
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e4},
    )
    again = TapeConfig.from_dict(config.to_dict())
    assert again.tape_block == (2, 4) and again.rope_parameters == config.rope_parameters


@pytest.mark.parametrize("pe_type", ["tape", "fire", "path"])
@pytest.mark.parametrize("use_diff", [True, False])
def test_a_config_written_to_json_reads_back_equal(tmp_path, pe_type, use_diff):
    """transformers' ConfigTester round trip: to_json_file then from_json_file is the identity (auto_map included:
    every saved folder names its `tapelm.remote_code` modules)."""
    config = TapeConfig(**VALID, pe_type=pe_type)
    config.to_json_file(tmp_path / "config.json", use_diff=use_diff)
    again = TapeConfig.from_json_file(tmp_path / "config.json")
    assert again.to_dict() == config.to_dict()
    assert config.to_dict()["auto_map"]["AutoModelForCausalLM"] == "modeling_tape.TapeForCausalLM"
