"""The baselines as the paper ran them (official code VITA-Group/TAPE, models/llama/*.py), and their options."""

import math
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy
import pytest
import torch

from conftest import DEVICE, new_model, tiny_config, tiny_model, tokens
from tapelm import TapeConfig
from tapelm.fast_paths import NONE
from tapelm.positional import PositionContext
from tapelm.positional.bias import FireFunction
from test_cache import decode_in_chunks

pytestmark = pytest.mark.device

VALID = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def test_official_defaults():
    config = TapeConfig(**VALID)
    assert config.xpos_scale_base == 2048.0
    assert not config.fire_shared and not config.t5_shared
    assert config.fire_init_c == 0.1 and config.fire_init_threshold == 512.0
    assert config.randpe_eval_positions == "random"


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(fire_shared="yes"), "fire_shared"),
        (dict(t5_shared=1), "t5_shared"),
        (dict(fire_init_c=0.0), "fire_init_c"),
        (dict(fire_init_threshold=-1.0), "fire_init_threshold"),
        (dict(xpos_scale_base=0), "xpos_scale_base"),
        (dict(xpos_scale_base=float("inf")), "xpos_scale_base"),
        (dict(randpe_eval_positions="fixed"), "randpe_eval_positions"),
    ],
)
def test_invalid_baseline_options_are_named(overrides, field):
    with pytest.raises(ValueError, match=field):
        TapeConfig(**{**VALID, **overrides})


@pytest.mark.parametrize("pe_type, table", [("fire", "fire"), ("t5", "relative_attention_bias")])
def test_relative_biases_are_per_layer_unless_shared(pe_type, table):
    per_layer = tiny_model(pe_type, num_hidden_layers=3)
    shared = tiny_model(pe_type, num_hidden_layers=3, **{f"{pe_type}_shared": True})
    assert all(hasattr(layer.positional, table) for layer in per_layer.model.layers)
    assert not hasattr(per_layer.model.positional, table)
    assert hasattr(shared.model.positional, table)
    assert not any(hasattr(layer.positional, table) for layer in shared.model.layers)
    one = sum(p.numel() for p in getattr(shared.model.positional, table).parameters())
    assert per_layer.num_parameters() - shared.num_parameters() == 2 * one


@pytest.mark.parametrize("pe_type, table", [("fire", "fire"), ("t5", "relative_attention_bias")])
def test_per_layer_copies_of_one_table_equal_the_shared_table(pe_type, table):
    """Per-layer biases with identical parameters compute what the shared bias computes."""
    shared = tiny_model(pe_type, dtype=torch.float64, num_hidden_layers=3, **{f"{pe_type}_shared": True})
    per_layer = tiny_model(pe_type, dtype=torch.float64, num_hidden_layers=3)
    state = {k: v for k, v in shared.state_dict().items() if not k.startswith(f"model.positional.{table}")}
    for i in range(3):
        for name, value in getattr(shared.model.positional, table).state_dict().items():
            state[f"model.layers.{i}.positional.{table}.{name}"] = value
    per_layer.load_state_dict(state)
    ids = tokens(2, 20)
    torch.testing.assert_close(per_layer(ids).logits, shared(ids).logits, atol=1e-12, rtol=0)
    randomized = tiny_model(pe_type, dtype=torch.float64, num_hidden_layers=3)
    assert not torch.allclose(randomized(ids).logits, shared(ids).logits)


@pytest.mark.parametrize("pe_type", ["fire", "t5"])
def test_shared_relative_bias_cache_parity(pe_type):
    model = tiny_model(pe_type, dtype=torch.float64, num_hidden_layers=3, **{f"{pe_type}_shared": True})
    ids = tokens(2, 14)
    full = model(ids, use_cache=False).logits
    torch.testing.assert_close(decode_in_chunks(model, ids, [5, 1, 1, 7]), full, atol=1e-10, rtol=0)


def test_fresh_fire_has_the_official_initialisation():
    fresh = new_model(tiny_config("fire"))
    for layer in fresh.model.layers:
        assert layer.positional.fire.c.item() == pytest.approx(0.1)
        assert layer.positional.fire.threshold_multiplier.item() == 1.0
        assert layer.positional.fire.init_threshold == 512.0


def test_fire_bias_is_the_official_formula():
    """MLP(log(|c (i-j)| + 1) / (log(|c max(i, L)| + 1) + 1e-6)), in float64."""
    with torch.device(DEVICE):
        fire = FireFunction(tiny_config("fire", fire_init_c=0.3, fire_init_threshold=6.0)).double()
    with torch.no_grad():
        fire.threshold_multiplier.fill_(-1.5)  # L = |-1.5 * 6| = 9
    positions = torch.arange(14, device=DEVICE)[None]
    ctx = PositionContext(paths=NONE, query_positions=positions[:, 10:], key_positions=positions)
    bias = fire(ctx, torch.float64).full()
    c = fire.c.item()  # 0.3 rounded to float32 at construction
    for i in range(10, 14):
        for j in range(14):
            x = math.log(abs(c * (i - j)) + 1) / (math.log(c * max(i, 9.0) + 1) + 1e-6)
            expected = fire.mlp(torch.tensor([[x]], dtype=torch.float64, device=DEVICE))[0]
            torch.testing.assert_close(bias[0, :, i - 10, j], expected, atol=1e-12, rtol=0)


def test_xpos_scale_base_changes_the_decay():
    ids = tokens(1, 16)
    default = tiny_model("xpos", dtype=torch.float64)
    other = tiny_model("xpos", dtype=torch.float64, xpos_scale_base=512.0)
    assert not torch.allclose(default(ids).logits, other(ids).logits)


def randpe_positions(model, ids: torch.Tensor) -> torch.Tensor:
    """The positions RandPE rotates q and k by in one forward pass of `model` on `ids`."""
    seen = []
    original = model.model.positional.positions

    def recording(*args):
        seen.append(original(*args))
        return seen[-1]

    model.model.positional.positions = recording
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        del model.model.positional.positions
    return seen[0]


def test_randpe_evaluates_on_random_positions_like_training():
    """Ruoss et al.'s code and the official code draw RandPE's positions at evaluation too: each forward pass gets a
    sorted subset of [0, randpe_max_position), drawn from torch's random state."""
    model = tiny_model("randpe", randpe_eval_positions="random", max_position_embeddings=32, randpe_max_position=64)
    ids = tokens(3, 20)
    for mode in (model.train, model.eval):
        mode()
        first, second = randpe_positions(model, ids), randpe_positions(model, ids)
        assert (first.diff(dim=-1) > 0).all() and first.min() >= 0 and first.max() < 64
        assert not torch.equal(first, second)
    torch.manual_seed(3)
    one = model(input_ids=ids, use_cache=False).logits
    torch.manual_seed(3)
    assert torch.equal(one, model(input_ids=ids, use_cache=False).logits)


def test_randpe_with_given_positions_evaluates_on_them():
    model = tiny_model("randpe", randpe_eval_positions="given")
    ids = tokens(2, 9)
    assert torch.equal(randpe_positions(model, ids), torch.arange(9, device=DEVICE).expand(2, 9))
    torch.testing.assert_close(
        model(input_ids=ids).logits, tiny_model("rope")(input_ids=ids).logits
    )  # same weights (seed 0), same positions


def test_randpe_random_positions_refuse_to_continue_a_cache():
    model = tiny_model("randpe", randpe_eval_positions="random")
    ids = tokens(1, 6)
    cache = model(input_ids=ids[:, :5], use_cache=True).cache
    with pytest.raises(ValueError, match="randpe_eval_positions='given'"):
        model(input_ids=ids[:, 5:], cache=cache, use_cache=True)


def exact_alibi_slopes(heads: int) -> list[Fraction]:
    """Press et al.'s slopes as exact exponents of 2: 2^(-8 (i+1) / n) for the n = 2^floor(log2 H) first heads, then
    every other slope of 2n heads, 2^(-4 (2 (i-n) + 1) / n)."""
    closest = 2 ** math.floor(math.log2(heads))
    return [
        Fraction(-8 * (i + 1), closest) if i < closest else Fraction(-4 * (2 * (i - closest) + 1), closest)
        for i in range(heads)
    ]


def nearest_float32(value: Decimal) -> float:
    """`value` correctly rounded to float32: the nearer of the float32 numbers around it."""
    near = numpy.float32(float(value))
    around = (numpy.nextafter(near, numpy.float32(-1)), near, numpy.nextafter(near, numpy.float32(2)))
    return float(min(around, key=lambda candidate: abs(Decimal(float(candidate)) - value)))


@pytest.mark.parametrize("heads", [1, 3, 4, 12, 16, 24, 48, 64, 96, 128, 192, 256])
def test_alibi_slopes_are_correctly_rounded_at_any_head_count(heads):
    """Against 60-digit decimal arithmetic: each float32 slope (what float32, bf16 and fp16 models use) is
    2^exponent correctly rounded; each float64 slope is within a float64 step of it (exp2 in float64 is faithful,
    not correctly rounded)."""
    from tapelm.positional.bias import alibi_slopes

    with localcontext() as context:
        context.prec = 60
        exact = [Decimal(2) ** (Decimal(e.numerator) / Decimal(e.denominator)) for e in exact_alibi_slopes(heads)]
    single = alibi_slopes(heads, DEVICE, torch.float32)
    assert single.dtype == torch.float32 and single.device == DEVICE
    expected = torch.tensor([nearest_float32(value) for value in exact], dtype=torch.float32, device="cpu")
    assert torch.equal(single.cpu(), expected)
    double = alibi_slopes(heads, DEVICE, torch.float64).cpu()
    nearest_double = torch.tensor([float(value) for value in exact], dtype=torch.float64, device="cpu")
    steps = (double - nearest_double).abs() / (
        torch.nextafter(nearest_double, torch.zeros_like(double)) - nearest_double
    ).abs()
    assert steps.max() <= 1
