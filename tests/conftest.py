"""Tiny models and helpers shared by the tests."""

from __future__ import annotations

import pytest
import torch

from tapelm import PE_TYPES, TapeConfig, TapeForCausalLM

VOCAB = 61


def tiny_config(pe_type: str = "tape", **overrides) -> TapeConfig:
    """A few-thousand-parameter model: 2 layers, 4 heads of dim 8 (2 KV heads). RandPE evaluates on the given
    positions here, so that it obeys the deterministic laws (its random evaluation has its own tests)."""
    options = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                   pe_type=pe_type, fire_hidden_size=8, cope_max_positions=16, randpe_eval_positions="given")
    options.update(overrides)
    return TapeConfig(**options)


def randomize(model: torch.nn.Module, std: float = 0.3, seed: int = 0) -> torch.nn.Module:
    """Give every parameter (TAPE's zero-initialised ones included) random non-zero values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float64).to(param.dtype)
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.copy_(1 + 0.1 * noise)
            elif "dense" in name:
                param.add_(0.1 * noise)
            else:
                param.copy_(std * noise)
    return model


def tiny_model(pe_type: str = "tape", dtype=torch.float32, seed: int = 0, **overrides) -> TapeForCausalLM:
    torch.manual_seed(seed)
    model = TapeForCausalLM(tiny_config(pe_type, **overrides))
    return randomize(model, seed=seed).to(dtype).eval()


def tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=PE_TYPES)
def pe_type(request) -> str:
    return request.param


def pytest_configure(config):
    """The marks transformers' own common tests use (tests/test_transformers_common.py), so they load without
    warnings."""
    for mark in ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test",
                 "torch_compile_test"):
        config.addinivalue_line("markers", f"{mark}: a mark of transformers' common tests")
