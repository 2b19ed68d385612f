"""bf16 models keep exact positions: angles come from integer positions in float32, never in bf16."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from conftest import DEVICE, randomize, tiny_config, tiny_model, tokens
from tapelm.fast_paths import NONE
from tapelm.kernels.attention import naive as reference_attention
from tapelm.kernels.state_update import add_attended
from tapelm.positional import PositionContext
from tapelm.positional.rotary import TapeRotaryEmbedding, rope_frequencies

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
    ctx = PositionContext(paths=NONE, query_positions=positions())
    model.model.positional.prepare(ctx, torch.bfloat16)
    half = model.config.head_dim // 2
    angles = ctx.tables["angles"][0, 0] if pe_type == "rope" else ctx.tables["e0"][0]  # [cos | sin]
    cos, sin = angles[:, :half], angles[:, half:]
    ref_cos, ref_sin = reference(model.config.rope_parameters["rope_theta"], model.config.head_dim)
    # bf16 storage rounds to 2^-9 relative; float32 angles add at most ~65536 * 2^-24 rad.
    tolerance = 2**-8 + 65536 * 2**-24
    assert (cos.double() - ref_cos).abs().max() < tolerance
    assert (sin.double() - ref_sin).abs().max() < tolerance
    # what a bf16 angle computation would give: positions rounded to multiples of 256 near 65536
    naive = (positions()[0, :, None].bfloat16() * torch.ones(half, dtype=torch.bfloat16, device=DEVICE)).double().cos()
    assert (naive - ref_cos[:, :1]).abs().max() > 10 * tolerance


@pytest.mark.parametrize(
    "pe_type", ["tape", "rope", "alibi", "fire", "sinusoidal", "fox", "path", "pope", "stickbreaking"]
)
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
    ctx = PositionContext(paths=NONE, query_positions=torch.tensor([[65535]], device=DEVICE))
    model.model.positional.prepare(ctx, torch.float32)
    e = ctx.tables["e0"][0, 0].double().unflatten(-1, (4, 4, 4))  # (M, L, R)
    theta = model.config.rope_parameters["rope_theta"]
    for block in range(4):
        for pair in range(2):
            angle = 65535 / theta ** (2 * (block + 4 * pair) / 16)
            rot = torch.tensor(
                [[math.cos(angle), math.sin(angle)], [-math.sin(angle), math.cos(angle)]],
                dtype=torch.float64,
                device=DEVICE,
            )
            idx = torch.tensor([pair, pair + 2], device=DEVICE)
            torch.testing.assert_close(e[block][idx][:, idx], rot, atol=65536 * 2**-23, rtol=0)


# --- bf16 autocast, as users train (accelerate's mixed_precision="bf16") --------------------------------------------

FAR = 4100  # beyond 4,096: bf16 holds integers exactly only up to 256, so positions there would be multiples of 32


@pytest.mark.parametrize("theta, head_dim", [(10000.0, 8), (500.0, 64), (1e6, 128)])
def test_rope_frequencies_are_what_the_rotary_embedding_holds(theta, head_dim):
    """The spectrum GRAPE-M starts from (`rope_frequencies`) is, bit for bit, the one transformers gives RoPE (both on
    the CPU, where transformers computes it)."""
    config = tiny_config("rope", head_dim=head_dim, rope_parameters={"rope_type": "default", "rope_theta": theta})
    assert torch.equal(rope_frequencies(theta, head_dim, torch.device("cpu")), TapeRotaryEmbedding(config).inv_freq)


def deep_model(pe_type: str) -> torch.nn.Module:
    """12 layers, random weights small enough that logits stay in a realistic range, in float64 (the reference)."""
    return randomize(
        tiny_model(pe_type, dtype=torch.float64, num_hidden_layers=12, max_position_embeddings=8192), std=0.15
    )


def bf16_logits(model, ids, positions, **inputs):
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        return model(ids, position_ids=positions, **inputs).logits


def rms(x: torch.Tensor) -> float:
    return x.double().pow(2).mean().sqrt().item()


def test_bf16_autocast_loses_no_precision_at_long_positions(pe_type):
    """bf16 autocast against the float64 reference: the error beyond position 4,096 is at most 2x the error at
    positions 0..47, where bf16 and float32 positions coincide (so only the float32 computations named in
    docs/COMPATIBILITY.md keep it there: angles in bf16 give ~40x); and under 5% of the logits' size."""
    reference = deep_model(pe_type)
    model = deep_model(pe_type).float()
    ids = tokens(4, 48)
    errors = {}
    for offset in (0, FAR):
        positions = torch.arange(offset, offset + 48, device=DEVICE).expand(4, -1)
        expected = reference(ids, position_ids=positions).logits
        errors[offset] = rms(bf16_logits(model, ids, positions) - expected)
        assert errors[offset] < 0.05 * rms(expected), (offset, errors[offset], rms(expected))
    assert errors[FAR] <= 2 * errors[0], errors


def test_bf16_autocast_cached_decoding_equals_the_full_pass(pe_type):
    """Cached and uncached logits under bf16 autocast, beyond position 4,096, agree within bf16's own error: their
    RMS difference is at most 1.5x the full pass's RMS error against float64 (two bf16 computations of one function
    with independent rounding differ by about 1.4x; measured here 0.4-0.8x; a wrong position or a stale cache entry
    gives ~100x)."""
    reference = deep_model(pe_type)
    model = deep_model(pe_type).float()
    ids = tokens(2, 24)
    positions = torch.arange(FAR, FAR + 24, device=DEVICE).expand(2, -1)
    with torch.no_grad():
        full = bf16_logits(model, ids, positions, use_cache=False)
        cache, chunks, start = DynamicCache(config=model.config), [], 0
        for size in (13, 1, 1, 9):
            part = slice(start, start + size)
            chunks.append(bf16_logits(model, ids[:, part], positions[:, part], cache=cache, use_cache=True))
            start += size
        bf16_error = rms(full - reference(ids, position_ids=positions).logits)
    assert rms(torch.cat(chunks, dim=1) - full) <= 1.5 * bf16_error


def tape_layer_and_context(tokens: int):
    """The first layer's TAPE hooks of a tiny float32 model with random weights, its config, and a context for a
    step of `tokens` tokens in a batch of 2."""
    model = tiny_model("tape", dtype=torch.float32).to(DEVICE)
    ctx = PositionContext(paths=NONE, query_positions=torch.zeros(2, tokens, dtype=torch.long, device=DEVICE))
    return model.model.layers[0].positional, model.config, ctx


@pytest.mark.parametrize("tokens_in_step", [1, 5])
def test_tape_state_updates_keep_the_state_in_float32_under_bf16_autocast(tokens_in_step):
    """TAPE's state is a residual stream: under bf16 autocast each update's product runs in bf16 and its sum with the
    state in float32. With a state of size 100 and updates of size about 1, rounding the state to bf16 in the sum (as
    one autocast `baddbmm` would) errs by ~0.4; the products' bf16 rounding alone by ~0.01."""
    layer, config, ctx = tape_layer_and_context(tokens_in_step)
    with torch.no_grad():
        layer.mix_up.mul_(0.01)  # the MLP update's product is of the state itself: maps of size ~0.01
    generator = torch.Generator().manual_seed(0)

    def draw(*shape, scale=1.0):
        return (scale * torch.randn(*shape, dtype=torch.float64, generator=generator, device="cpu")).to(DEVICE)

    state = draw(2, config.num_key_value_heads, tokens_in_step, config.head_dim, scale=100.0)
    attended = draw(2, config.num_attention_heads, tokens_in_step, config.head_dim)
    mlp_out = draw(2, tokens_in_step, config.hidden_size)
    layer.double()
    expected = (add_attended(state, attended, layer.attn_mix), layer.after_mlp(state, mlp_out, ctx))
    layer.float()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        actual = (
            add_attended(state.float(), attended.bfloat16(), layer.attn_mix),
            layer.after_mlp(state.float(), mlp_out.float(), ctx),
        )
    for name, got, want in zip(("attention update", "MLP update"), actual, expected):
        assert got.dtype == torch.float32, name
        assert (got.double() - want).abs().max() < 0.05, name


def test_tape_attention_update_takes_features_of_another_dtype_than_the_state():
    """A float32 state updated from bf16 attended features without autocast (a base model whose projections compute
    in bf16, as quantised ones do): the sum is taken in float32, as state + the bf16 product."""
    layer, config, ctx = tape_layer_and_context(3)
    generator = torch.Generator().manual_seed(0)
    state = torch.randn(2, config.num_key_value_heads, 3, config.head_dim, generator=generator, device="cpu")
    attended = torch.randn(2, config.num_attention_heads, 3, config.head_dim, generator=generator, device="cpu")
    state, attended = state.to(DEVICE), attended.to(DEVICE, torch.bfloat16)
    updated = add_attended(state, attended, layer.attn_mix)
    product = torch.einsum("gh,bhnf->bgnf", layer.attn_mix.bfloat16(), attended)
    assert updated.dtype == torch.float32
    torch.testing.assert_close(updated, state + product, rtol=0, atol=0.05 * product.abs().max().item())


class _Operations(TorchDispatchMode):
    """Every aten operation a block runs, with the dtype of its first tensor argument."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, torch.dtype | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = next((x for x in args if isinstance(x, torch.Tensor)), None)
        self.seen.append((func.overloadpacket.__name__, None if first is None else first.dtype))
        return func(*args, **(kwargs or {}))


def _autocast_training_step(model, ids):
    """Logits and every parameter's gradient of a bf16-autocast step of `model` on `ids`."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    return [out.logits.detach()] + [p.grad for p in model.parameters() if p.grad is not None]


def test_tape_reference_attention_pads_after_autocasts_cast(monkeypatch):
    """The reference attention call zero-pads q and k to the [V | E] stream's width in the dtype SDPA computes in:
    under bf16 autocast, after the cast SDPA would make itself. The logits and every gradient are bit for bit (on the
    CPU; on a GPU within its attention backward's order of summation) those of padding the float32 rotated q and k
    first, with no float32 padding forward or backward, and the attention output's split into V's and E's parts
    comes back in the backward pass as one join, not as zero-filled slices."""
    model = tiny_model("tape", fast_paths="off").train()
    ids = tokens(2, 12)
    operations = _Operations()
    with operations:
        padded_in_bf16 = _autocast_training_step(model, ids)
    pads = [dtype for name, dtype in operations.seen if name == "constant_pad_nd" and dtype.is_floating_point]
    assert pads and set(pads) == {torch.bfloat16}
    assert "slice_backward" not in {name for name, _ in operations.seen}
    monkeypatch.setattr(reference_attention, "sdpa_dtype", lambda *tensors: tensors[0].dtype)  # pad as given (float32)
    padded_in_float32 = _autocast_training_step(model, ids)
    assert len(padded_in_bf16) == len(padded_in_float32)
    for got, want in zip(padded_in_bf16, padded_in_float32):  # a GPU's attention backward may sum in any order
        tolerance = 0.0 if DEVICE.type == "cpu" else 1e-2
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * want.abs().max().item())
