"""bf16 models keep exact positions: angles come from integer positions in float32, never in bf16."""

import math

import pytest
import torch

from tapelm.positional import PositionContext

from conftest import DEVICE, tiny_model, tokens

pytestmark = pytest.mark.device



def positions() -> torch.Tensor:
    return torch.arange(65536, device=DEVICE)[None]


def reference(theta: float, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=DEVICE) / head_dim)
    angles = positions()[0, :, None].double() * inv_freq
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("pe_type", ["rope", "tape"])
def test_bf16_angles_are_exact_to_65536(pe_type):
    model = tiny_model(pe_type, dtype=torch.bfloat16)
    ctx = PositionContext(query_positions=positions())
    model.model.positional.prepare(ctx, torch.bfloat16)
    half = model.config.head_dim // 2
    if pe_type == "rope":
        cos, sin = ctx.tables["q_cos"][0, 0, :, :half], ctx.tables["q_sin"][0, 0, :, :half]
    else:
        cos, sin = ctx.tables["e0"][0, :, :half], ctx.tables["e0"][0, :, half:]
    ref_cos, ref_sin = reference(model.config.rope_parameters["rope_theta"], model.config.head_dim)
    # bf16 storage rounds to 2^-9 relative; float32 angles add at most ~65536 * 2^-24 rad.
    tolerance = 2**-8 + 65536 * 2**-24
    assert (cos.double() - ref_cos).abs().max() < tolerance
    assert (sin.double() - ref_sin).abs().max() < tolerance
    # what a bf16 angle computation would give: positions rounded to multiples of 256 near 65536
    naive = (positions()[0, :, None].bfloat16() * torch.ones(half, dtype=torch.bfloat16, device=DEVICE)).double().cos()
    assert (naive - ref_cos[:, :1]).abs().max() > 10 * tolerance


@pytest.mark.parametrize("pe_type", ["tape", "rope", "alibi", "fire", "sinusoidal", "fox", "path"])
def test_bf16_forward_and_generate_run_at_long_positions(pe_type):
    model = tiny_model(pe_type, dtype=torch.bfloat16, max_position_embeddings=65536)
    ids = tokens(1, 8)
    positions = torch.arange(65520, 65528, device=DEVICE)[None]
    logits = model(ids, position_ids=positions).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 12)


def test_e0_matches_float64_rope_for_general_blocks():
    """The general L x R initial state at large positions equals a float64 construction (to float32 precision)."""
    model = tiny_model("tape", tape_block=(4, 4), head_dim=16, hidden_size=64)
    ctx = PositionContext(query_positions=torch.tensor([[65535]], device=DEVICE))
    model.model.positional.prepare(ctx, torch.float32)
    e = ctx.tables["e0"][0, 0].double().unflatten(-1, (4, 4, 4))  # (M, L, R)
    theta = model.config.rope_parameters["rope_theta"]
    for block in range(4):
        for pair in range(2):
            angle = 65535 / theta ** (2 * (block + 4 * pair) / 16)
            rot = torch.tensor([[math.cos(angle), math.sin(angle)], [-math.sin(angle), math.cos(angle)]],
                               dtype=torch.float64, device=DEVICE)
            idx = torch.tensor([pair, pair + 2], device=DEVICE)
            torch.testing.assert_close(e[block][idx][:, idx], rot, atol=65536 * 2**-23, rtol=0)
