"""GRAPE's laws: tapelm's attention equals the authors' released computation (tests/grape_reference.py) in its logits
and every gradient; the special cases (RoPE, ALiBi, FoX) where the parameterisation expresses them; the relative laws.

tapelm rotates as RoPE does and the authors' code the other way; the two are the same function once the second half
of every q, k (and GRAPE-AP's p) head is negated, `flip`, so the reference gets tapelm's weights through that map and
every gradient is compared at tapelm's own parameters."""

from __future__ import annotations

import math

import pytest
import torch

import grape_reference as ref
from conftest import DEVICE, decode_in_chunks, first_layer_logits, tiny_config, tiny_model
from tapelm.kernels.forgetting_attention.naive import forgetting_bias
from tapelm.kernels.rotation import rotate_halves
from tapelm.positional.grape_ap import last_seen, path_integral_bias

HEADS, DIM, HIDDEN, LENGTH = 4, 8, 32, 12


def grape_model(pe_type: str, **overrides):
    """A float64 tiny model with multi-head attention (as the authors' models) and random weights."""
    return tiny_model(pe_type, dtype=torch.float64, num_key_value_heads=HEADS, **overrides)


def attention_input(seed: int = 1, length: int = LENGTH) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, length, HIDDEN, generator=generator, dtype=torch.float64, device="cpu")
    return x.to(DEVICE).requires_grad_()


def flip(weight: torch.Tensor, width: int) -> torch.Tensor:
    """An (heads * width, C) projection with the second half of every head's rows negated."""
    sign = torch.ones(width, dtype=weight.dtype, device=weight.device)
    sign[width // 2 :] = -1
    return weight * sign.repeat(weight.shape[0] // width)[:, None]


def rope_log_freq(spectrum, scale: float) -> torch.Tensor:
    """The authors' log_freq for tapelm's spectrum: scale * log(RoPE's frequencies) + the learned shift."""
    rope = ref.rope_frequencies(DIM, 10000.0, torch.float64, spectrum.log_freq_shift.device)
    return scale * rope.log() + spectrum.log_freq_shift


def authors_logits(model, pe_type: str, x: torch.Tensor, tie: str = "none", width: int = 8) -> torch.Tensor:
    """The reference's logits of layer 0 with tapelm's weights (through `flip`)."""
    attention, positional = model.model.layers[0].self_attn, model.model.layers[0].positional
    wq, wk = flip(attention.q_proj.weight, DIM), flip(attention.k_proj.weight, DIM)
    if pe_type == "grape-m-fixed":
        return ref.grape_m_fixed(x, wq, wk, rope_log_freq(positional.spectrum, 16.0), HEADS)
    if pe_type == "grape-m":
        return ref.grape_m_contextual(
            x,
            wq,
            wk,
            positional.increment.weight,
            positional.increment.bias,
            rope_log_freq(positional.spectrum, 1.0),
            HEADS,
        )
    if pe_type.startswith("grape-a-"):  # no rotation, so no flip: the gates read q and k as they are
        return ref.grape_a(
            x,
            attention.q_proj.weight,
            attention.k_proj.weight,
            positional.omega,
            positional.query_gate,
            positional.key_gate,
            HEADS,
            positional.normalize,
        )
    wp = flip(positional.projection.weight, width) if tie == "none" else None
    return ref.grape_ap(x, wq, wk, flip(attention.v_proj.weight, DIM), wp, HEADS, tie, width)


CASES = [
    ("grape-m-fixed", {}),
    ("grape-m-fixed", {"grape_share_across_heads": False}),
    ("grape-m", {}),
    ("grape-m", {"grape_ctx_per_head": True, "grape_share_across_heads": False}),
    ("grape-ap", {"grape_ap_head_dim": 4}),
    ("grape-ap", {"grape_ap_tie": "q"}),
    ("grape-ap", {"grape_ap_tie": "k"}),
    ("grape-ap", {"grape_ap_tie": "v"}),
    ("grape-a-q", {}),
    ("grape-a-k", {}),
    ("grape-a-qk", {}),
    ("grape-a-qk", {"grape_a_gate_l2_norm": False}),
]


@pytest.mark.device
@pytest.mark.parametrize(
    "pe_type, options", CASES, ids=[f"{pe}-{'-'.join(map(str, o.values())) or 'default'}" for pe, o in CASES]
)
def test_the_attention_logits_and_every_gradient_equal_the_authors(pe_type, options):
    """Same weights (up to `flip`), float64: the logits and the gradients of every parameter and of the input."""
    model = grape_model(pe_type, **options)
    x = attention_input()
    ours = first_layer_logits(model, x)
    theirs = authors_logits(
        model, pe_type, x, options.get("grape_ap_tie", "none"), options.get("grape_ap_head_dim", DIM)
    )
    seen = torch.isfinite(theirs)
    assert torch.equal(torch.isfinite(ours), seen) and seen.sum() == 2 * HEADS * LENGTH * (LENGTH + 1) // 2
    torch.testing.assert_close(ours[seen], theirs[seen], atol=1e-12, rtol=0)
    weights = torch.randn(ours.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64, device="cpu").to(
        DEVICE
    )
    leaves = [x, *(p for p in model.model.layers[0].parameters() if p.requires_grad)]
    expected = torch.autograd.grad((theirs.where(seen, 0) * weights).sum(), leaves, allow_unused=True)
    got = torch.autograd.grad((ours.where(seen, 0) * weights).sum(), leaves, allow_unused=True)
    compared = 0
    for name, g, e in zip(
        ["x", *(n for n, p in model.model.layers[0].named_parameters() if p.requires_grad)], got, expected
    ):
        assert (g is None) == (e is None), name
        if g is not None:
            torch.testing.assert_close(g, e, atol=1e-11, rtol=0, msg=name)
            compared += 1
    assert compared >= 3  # x, q and k at least


def test_the_released_rotation_is_ropes_of_negated_positions():
    """The authors turn each pair by minus the angle: RoPE's (and tapelm's) rotation at position -t."""
    x = torch.randn(1, LENGTH, HEADS, DIM, dtype=torch.float64)
    rope = ref.rope_frequencies(DIM, 10000.0, torch.float64, "cpu")
    angles = torch.arange(LENGTH, dtype=torch.float64)[:, None, None] * rope
    theirs = ref.released_rotation(x, angles.cos(), angles.sin())
    torch.testing.assert_close(theirs, rotate_halves(x, (-angles).cos(), (-angles).sin()), atol=1e-15, rtol=0)
    assert not torch.allclose(theirs, rotate_halves(x, angles.cos(), angles.sin()))


def copied_into(source, pe_type: str, **overrides):
    """A model of `pe_type` with `source`'s weights (its positional parameters left out)."""
    model = grape_model(pe_type, **overrides)
    shared = {name: value for name, value in source.state_dict().items() if ".positional." not in name}
    assert not model.load_state_dict(shared, strict=False).unexpected_keys
    return model


@pytest.mark.device
def test_grape_m_fixed_at_its_initial_frequencies_is_rope_bit_for_bit():
    """Frozen (or fresh) frequencies are RoPE's: the same logits to the last bit, in float32."""
    model = tiny_model("grape-m-fixed", grape_learnable_freq=False)
    for layer in model.model.layers:
        layer.positional.spectrum.init_weights(torch.nn.init, 0.02)
    rope = tiny_model("rope")
    rope.load_state_dict(model.state_dict(), strict=False)
    ids = torch.randint(0, 61, (2, 40), generator=torch.Generator().manual_seed(3), device="cpu").to(DEVICE)
    assert torch.equal(model(ids).logits, rope(ids).logits)


@pytest.mark.device
@pytest.mark.parametrize("c", [0.5, 0.25, 0.125])
def test_grape_m_with_a_constant_increment_is_rope_at_scaled_positions(c):
    """With w = 0 the increment is a constant c = sigmoid(b / 16) and Phi_t = c t: RoPE with transformers' linear
    scaling by 1/c (frozen RoPE frequencies and c = 1 would be RoPE itself; the sigmoid keeps c below 1). Powers of
    1/2, so that transformers' float32 frequencies divided by 1/c are exact."""
    logit = 16 * math.log(c / (1 - c))
    model = grape_model("grape-m")
    for layer in model.model.layers:
        layer.positional.spectrum.init_weights(torch.nn.init, 0.02)
        torch.nn.init.zeros_(layer.positional.increment.weight)
        torch.nn.init.constant_(layer.positional.increment.bias, logit)
    rope = copied_into(model, "rope", rope_parameters={"rope_type": "linear", "factor": 1 / c, "rope_theta": 10000.0})
    ids = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(4), device="cpu").to(DEVICE)
    torch.testing.assert_close(model(ids).logits, rope(ids).logits, atol=1e-10, rtol=0)


@pytest.mark.device
def test_grape_ap_with_a_constant_term_is_alibi():
    """A zero positional projection makes every term log sigmoid(0) = -ln 2: ALiBi with its slopes times ln 2."""
    model = grape_model("grape-ap")
    torch.nn.init.zeros_(model.model.layers[0].positional.projection.weight)
    nope = copied_into(model, "nope")
    x = attention_input()
    bias = first_layer_logits(model, x) - first_layer_logits(nope, x)
    distance = torch.arange(LENGTH, device=DEVICE)[:, None] - torch.arange(LENGTH, device=DEVICE)[None]
    slopes = ref.alibi_slopes(HEADS)
    alibi = -torch.tensor(slopes, dtype=torch.float64, device=DEVICE)[:, None, None] * distance
    seen = distance >= 0
    torch.testing.assert_close(bias[:, :, seen], (math.log(2) * alibi[:, seen]).expand(2, -1, -1), atol=1e-12, rtol=0)


def test_a_path_integral_whose_terms_depend_on_the_key_alone_is_fox():
    """With one query vector for every token (unit slopes) the term of key l is log f_l = log sigmoid(p . r_l / d):
    FoX's bias sum_{j < l <= i} log f_l. The authors' projection gives each token its own p, so a model expresses
    this only where its inputs do; the bias itself is held to FoX's here."""
    generator = torch.Generator().manual_seed(5)
    p = torch.randn(1, 2, 1, 4, generator=generator, dtype=torch.float64).expand(-1, -1, LENGTH, -1)
    rotated = torch.randn(1, 2, LENGTH, 4, generator=generator, dtype=torch.float64)
    valid = torch.ones(1, 1, LENGTH, LENGTH, dtype=torch.bool).tril()
    ours = path_integral_bias(p, rotated, torch.ones(2, dtype=torch.float64), last_seen(valid), torch.float64).full()
    log_f = torch.nn.functional.logsigmoid((p[:, :, :1] * rotated).sum(-1) / 4)  # (1, 2, T)
    cumulative = log_f.cumsum(-1)[..., None]
    fox = forgetting_bias(cumulative, cumulative.transpose(-1, -2), torch.float64).full()
    torch.testing.assert_close(ours[valid.expand_as(ours)], fox[valid.expand_as(fox)], atol=1e-12, rtol=0)


@pytest.mark.device
@pytest.mark.parametrize("pe_type, gates", [("grape-a-q", 1), ("grape-a-k", 1), ("grape-a-qk", 2)])
def test_grape_a_with_a_constant_gate_is_alibi(pe_type, gates):
    """Zero gate directions make every gate softplus(0) = ln 2 (the query's plus the key's in GRAPE-A-QK); with
    softplus(w_h) = 1 / (that sum) the bias is ALiBi's with its per-head slopes: the whole model is the ALiBi model
    with the same weights."""
    model = grape_model(pe_type)
    for layer in model.model.layers:
        positional = layer.positional
        for direction in (positional.query_gate, positional.key_gate):
            if direction is not None:
                torch.nn.init.zeros_(direction)
        torch.nn.init.constant_(positional.omega, math.log(math.expm1(1 / (gates * math.log(2)))))
    alibi = copied_into(model, "alibi")
    ids = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(8), device="cpu").to(DEVICE)
    torch.testing.assert_close(model(ids).logits, alibi(ids).logits, atol=1e-10, rtol=0)


@pytest.mark.device
def test_grape_a_qk_bias_is_the_query_gated_plus_the_key_gated_bias():
    """With the same rate and directions, GRAPE-A-QK's bias is GRAPE-A-Q's plus GRAPE-A-K's."""
    both = grape_model("grape-a-qk")
    x = attention_input()
    nope = first_layer_logits(copied_into(both, "nope"), x)
    positional = both.model.layers[0].positional
    parts = []
    for pe_type, gate in (("grape-a-q", "query_gate"), ("grape-a-k", "key_gate")):
        model = copied_into(both, pe_type)
        with torch.no_grad():
            model.model.layers[0].positional.omega.copy_(positional.omega)
            getattr(model.model.layers[0].positional, gate).copy_(getattr(positional, gate))
        parts.append(first_layer_logits(model, x) - nope)
    seen = torch.isfinite(nope)
    torch.testing.assert_close(
        (first_layer_logits(both, x) - nope)[seen], (parts[0] + parts[1])[seen], atol=1e-12, rtol=0
    )
    assert (parts[0][seen] < 0).any() and (parts[1][seen] < 0).any()


@pytest.mark.device
@pytest.mark.parametrize("pe_type", ["grape-a-q", "grape-a-k", "grape-a-qk"])
def test_grape_a_bias_is_relative_and_gated_by_content(pe_type):
    """The bias reads positions only through i - j: shifting every position changes no logit (a law that is not
    vacuous: the gates read q and k, so the model is not the ALiBi model with its weights)."""
    model = grape_model(pe_type)
    ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(9), device="cpu").to(DEVICE)
    positions = torch.arange(16, device=DEVICE)[None].expand(2, -1)
    logits = model(ids, position_ids=positions).logits
    torch.testing.assert_close(model(ids, position_ids=positions + 37).logits, logits, atol=1e-10, rtol=0)
    alibi = copied_into(model, "alibi")
    assert not torch.allclose(alibi(ids).logits, logits, atol=1e-6)


@pytest.mark.device
@pytest.mark.parametrize("pe_type", ["grape-m-fixed", "grape-m"])
def test_the_logits_depend_only_on_the_phase_difference(pe_type):
    """Putting a token in front advances every later token's phase (position, or accumulated increments) by the same
    amount: the logits among the later tokens do not change."""
    model = grape_model(pe_type)
    x = attention_input(length=LENGTH + 1)
    torch.testing.assert_close(
        first_layer_logits(model, x)[:, :, 1:, 1:], first_layer_logits(model, x[:, 1:]), atol=1e-12, rtol=0
    )


@pytest.mark.device
def test_contextual_logits_are_the_keys_turned_by_the_phase_difference():
    """q_i . R((Phi_j - Phi_i) theta) k_j / sqrt(d), Phi the exclusive running sum of the increments."""
    model = grape_model("grape-m")
    layer = model.model.layers[0]
    x = attention_input()
    omega = torch.sigmoid(layer.positional.increment(x) / 16)[..., 0]  # (B, T)
    phi = omega.cumsum(-1) - omega
    theta = layer.positional.spectrum.frequencies(torch.float64)[0]
    difference = (phi[:, None, :] - phi[:, :, None])[..., None] * theta  # (B, i, j, d/2)
    q = layer.self_attn.q_proj(x).view(2, LENGTH, HEADS, DIM)
    k = layer.self_attn.k_proj(x).view(2, LENGTH, HEADS, DIM)
    turned = rotate_halves(
        k[:, None].expand(-1, LENGTH, -1, -1, -1), difference.cos()[:, :, :, None], difference.sin()[:, :, :, None]
    )
    expected = torch.einsum("bihd,bijhd->bhij", q, turned) / math.sqrt(DIM)
    ours = first_layer_logits(model, x)
    seen = torch.isfinite(ours)
    torch.testing.assert_close(ours[seen], expected[seen], atol=1e-12, rtol=0)


@pytest.mark.device
def test_grape_ap_sees_absolute_key_positions_as_the_released_code_does():
    """The released GRAPE-AP turns key l's vector by its own position against an unturned query vector, so shifting
    every position changes the bias (the paper's relative law does not hold for it); tapelm keeps that."""
    model = grape_model("grape-ap")
    ids = torch.randint(0, 61, (1, 16), generator=torch.Generator().manual_seed(6), device="cpu").to(DEVICE)
    positions = torch.arange(16, device=DEVICE)[None]
    assert not torch.allclose(model(ids, position_ids=positions + 5).logits, model(ids, position_ids=positions).logits)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(pe_type="grape-m", causal=False), "causal"),
        (dict(pe_type="grape-ap", causal=False), "causal"),
        (dict(grape_ap_tie="pq"), "grape_ap_tie"),
        (dict(pe_type="grape-ap", grape_ap_head_dim=3), "grape_ap_head_dim"),
        (dict(grape_ap_head_dim=0), "grape_ap_head_dim"),
        (dict(grape_ctx_omega_scale=0), "grape_ctx_omega_scale"),
        (dict(grape_ctx_init_omega=-1e-3), "grape_ctx_init_omega"),
        (dict(grape_log_freq_scale=float("inf")), "grape_log_freq_scale"),
        (dict(grape_ap_base=0.0), "grape_ap_base"),
        (dict(pe_type="grape-a-k", causal=False), "causal"),
        (dict(grape_a_omega_init=0.0), "grape_a_omega_init"),
        (dict(grape_a_gate_l2_norm="yes"), "grape_a_gate_l2_norm"),
        (dict(grape_share_across_heads=1), "grape_share_across_heads"),
        (
            dict(pe_type="grape-m-fixed", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
            "rope_type='linear' is not allowed with pe_type='grape-m-fixed'",
        ),
        (dict(pe_type="grape-m", hidden_size=28, head_dim=7), "head_dim=7 must be even"),
    ],
)
def test_invalid_grape_options_are_named_in_one_line(overrides, field):
    with pytest.raises(ValueError, match=field) as error:
        tiny_config(**{"pe_type": "grape-m", **overrides})
    assert "\n" not in str(error.value)


@pytest.mark.device
@pytest.mark.parametrize(
    "pe_type, options",
    [
        ("grape-m-fixed", {"grape_share_across_heads": False}),
        ("grape-m", {"grape_ctx_per_head": True, "grape_share_across_heads": False}),
        ("grape-ap", {"grape_ap_tie": "q"}),
        ("grape-ap", {"grape_ap_tie": "k"}),
        ("grape-ap", {"grape_ap_tie": "v"}),
        ("grape-a-qk", {"grape_a_gate_l2_norm": False}),
    ],
)
def test_every_option_decodes_through_the_cache_as_a_full_pass(pe_type, options):
    """The options the shared law tests do not reach, with grouped KV heads (per-KV-head spectra and increments, a
    tied vector shared by a query group): chunked and token-by-token decoding equal one pass."""
    model = tiny_model(pe_type, dtype=torch.float64, **options)
    ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(7), device="cpu").to(DEVICE)
    torch.testing.assert_close(decode_in_chunks(model, ids, [5, 1, 1, 9]), model(ids).logits, atol=1e-10, rtol=0)
