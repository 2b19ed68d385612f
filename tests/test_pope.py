"""PoPE's laws: tapelm's attention logits and every gradient equal x-transformers' `polar_pos_emb` attention given the
same weights, and the paper's logit restated in float64; with no phase offset PoPE is RoPE (at twice the head width,
the same spectrum) of the softplus magnitudes with zero imaginary parts; its config fields are checked. The shared law
tests (shift invariance, padding, packing, caches, devices, autocast) run it through the lists of tests/test_laws.py
and the parametrisations over every encoding."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import DEVICE, WEIGHT_STD, decode_in_chunks, new_model, tiny_config, tiny_model, tokens
from tapelm import TapeConfig
from tapelm.fast_paths import NONE
from tapelm.positional import PositionContext
from tapelm.positional.rotary import RoPE, RotaryLayer, rope_frequencies
from tapelm.testing import LAWS, Subject

HEADS, DIM, HIDDEN, LENGTH = 4, 8, 32, 12


def pope_model(**overrides):
    """A float64 tiny model with multi-head attention (x-transformers' `polar_pos_emb` has one offset per query head
    and adds it to the keys) and phase offsets spread over [-7, 0.5], some beyond the clamp on either side."""
    model = tiny_model("pope", dtype=torch.float64, num_key_value_heads=HEADS, **overrides)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            offsets = torch.rand(HEADS, DIM, generator=generator, dtype=torch.float64, device="cpu") * 7.5 - 7.0
            layer.positional.phase_bias.copy_(offsets.to(DEVICE))
    return model


def attention_input(seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(2, LENGTH, HIDDEN, generator=generator, dtype=torch.float64, device="cpu")
        .to(DEVICE)
        .requires_grad_()
    )


def context(positions: torch.Tensor, encoding) -> PositionContext:
    ctx = PositionContext(query_positions=positions, key_positions=positions, paths=NONE)
    encoding.prepare(ctx, torch.float64)
    return ctx


def tapelm_logits(model, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Layer 0's pre-softmax logits (B, H, T, T) of its attention input x, every query-key pair (no mask), through
    the hooks the decoder calls."""
    attention, positional = model.model.layers[0].self_attn, model.model.layers[0].positional
    batch, length, _ = x.shape
    q, k = (proj(x).view(batch, length, -1, DIM).transpose(1, 2) for proj in (attention.q_proj, attention.k_proj))
    positions = torch.arange(length, device=x.device).expand(batch, -1) if positions is None else positions
    q, k = positional.transform_qk(q, k, None, context(positions, model.model.positional))
    assert q.shape[-1] == k.shape[-1] == 2 * DIM
    return q @ k.transpose(-1, -2) * positional.logit_scale(DIM)


def compare_with_gradients(model, x, ours, theirs, their_leaves, atol, grad_atol, offsets_of=lambda g: g):
    """The logits, then the gradients of a fixed random weighting of them with respect to x, W_q, W_k and the phase
    offsets (`offsets_of` brings the reference's offset gradient to tapelm's shape)."""
    torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)
    weights = torch.randn(ours.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64, device="cpu").to(
        DEVICE
    )
    attention, positional = model.model.layers[0].self_attn, model.model.layers[0].positional
    leaves = [x, attention.q_proj.weight, attention.k_proj.weight, positional.phase_bias]
    got = torch.autograd.grad((ours * weights).sum(), leaves)
    expected = list(torch.autograd.grad((theirs * weights).sum(), their_leaves))
    expected[-1] = offsets_of(expected[-1])
    for name, g, e in zip(["x", "q_proj", "k_proj", "phase_bias"], got, expected):
        assert g.abs().max() > 0, name
        torch.testing.assert_close(g, e, atol=grad_atol, rtol=0, msg=name)


@pytest.mark.device
def test_the_logits_and_every_gradient_equal_x_transformers():
    """x-transformers' Attention with `polar_pos_emb` (its PolarEmbedding's frequencies and clamped offsets), given
    tapelm's weights, in float64. The reference computes magnitudes and products in float32 whatever its input
    (`apply_polar_pos_emb` calls `.float()`), so the two agree to float32's precision, not float64's (the float64
    restatement below holds tapelm to 1e-12)."""
    xt = pytest.importorskip(
        "x_transformers.x_transformers", reason="x-transformers is not installed (pip install tapelm[dev])"
    )
    model = pope_model()
    attention, positional = model.model.layers[0].self_attn, model.model.layers[0].positional
    reference = xt.Attention(HIDDEN, dim_head=DIM, heads=HEADS, causal=True).to(DEVICE, torch.float64)
    polar = xt.PolarEmbedding(DIM, HEADS).to(DEVICE, torch.float64)
    with torch.no_grad():
        reference.to_q.weight.copy_(attention.q_proj.weight)
        reference.to_k.weight.copy_(attention.k_proj.weight)
        polar.learned_bias.copy_(positional.phase_bias[:, None])
    x = attention_input()
    theirs_x = x.detach().clone().requires_grad_()
    _, intermediates = reference(
        theirs_x, polar_pos_emb=polar(torch.arange(LENGTH, device=DEVICE)), return_intermediates=True
    )
    compare_with_gradients(
        model,
        x,
        tapelm_logits(model, x),
        intermediates.qk_similarities,
        [theirs_x, reference.to_q.weight, reference.to_k.weight, polar.learned_bias],
        atol=1e-5,
        grad_atol=1e-4,
        offsets_of=lambda g: g[:, 0],
    )


def paper_logits(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """sum_c softplus(q_ic) softplus(k_jc) cos((i - j) theta_c - delta_c) / sqrt(d), written out per pair in float64
    (q, k (B, H, T, d), positions (B, T), offsets (H, d) clamped to [-2 pi, 0])."""
    # theta_c = 10000 ** (-c / d), computed in float32 as transformers' default RoPE and x-transformers compute it
    theta = (1.0 / 10000.0 ** (torch.arange(DIM, device=q.device).float() / DIM)).double()
    distance = (positions[:, :, None] - positions[:, None, :]).to(torch.float64)  # (B, T, T)
    delta = offsets.clamp(-2 * math.pi, 0)[None, :, None, None, :]
    phases = distance[:, None, :, :, None] * theta - delta  # (B, H, T, T, d)
    magnitudes = torch.nn.functional.softplus(q)[..., :, None, :] * torch.nn.functional.softplus(k)[..., None, :, :]
    return (magnitudes * phases.cos()).sum(-1) / math.sqrt(DIM)


@pytest.mark.device
def test_the_logits_and_every_gradient_equal_the_papers_formula_in_float64():
    """The logit as a sum over frequencies of magnitude products times the cosine of the phase difference, at
    restarted (packed) and shifted positions."""
    model = pope_model()
    attention, positional = model.model.layers[0].self_attn, model.model.layers[0].positional
    x = attention_input()
    positions = torch.tensor([list(range(5)) + list(range(7)), list(range(100, 100 + LENGTH))], device=DEVICE)
    wq, wk = attention.q_proj.weight.detach().clone(), attention.k_proj.weight.detach().clone()
    offsets = positional.phase_bias.detach().clone()
    theirs_x = x.detach().clone().requires_grad_()
    leaves = [theirs_x, wq.requires_grad_(), wk.requires_grad_(), offsets.requires_grad_()]
    q, k = ((theirs_x @ w.T).view(2, LENGTH, HEADS, DIM).transpose(1, 2) for w in (wq, wk))
    compare_with_gradients(
        model, x, tapelm_logits(model, x, positions), paper_logits(q, k, positions, offsets), leaves, 1e-12, 1e-11
    )


@pytest.mark.device
def test_without_phase_offsets_pope_is_rope_of_real_softplus_features_at_twice_the_head_width():
    """delta = 0: PoPE's q and k are RoPE's rotation, at head width 2d and the same rope_theta (so the same d
    frequencies theta ** (-c / d)), of [softplus(q) | 0] and [softplus(k) | 0]: features whose imaginary parts are 0,
    so the phase comes from the position alone. Hence with magnitudes taken as the identity (q, k > 0 given as
    softplus^-1 of themselves) PoPE's logit is RoPE's for those zero-imaginary features,
    sum_c q_c k_c cos((i - j) theta_c)."""
    model = pope_model()
    positional = model.model.layers[0].positional
    with torch.no_grad():
        positional.phase_bias.zero_()
    generator = torch.Generator().manual_seed(4)
    q = torch.rand(2, HEADS, LENGTH, DIM, generator=generator, dtype=torch.float64, device="cpu").to(DEVICE) + 0.1
    k = torch.rand(2, HEADS, LENGTH, DIM, generator=generator, dtype=torch.float64, device="cpu").to(DEVICE) + 0.1
    positions = torch.arange(LENGTH, device=DEVICE).expand(2, -1) + 7
    inverse = lambda x: x.expm1().log()  # noqa: E731 (softplus^-1)
    ours = positional.transform_qk(inverse(q), inverse(k), None, context(positions, model.model.positional))
    rope = RoPE(tiny_config("rope", head_dim=2 * DIM)).to(DEVICE)
    padded = [torch.cat([x, torch.zeros_like(x)], dim=-1) for x in (q, k)]
    theirs = RotaryLayer().transform_qk(*padded, None, context(positions, rope))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    distance = (positions[0, :, None] - positions[0, None, :]).to(torch.float64)
    theta = rope_frequencies(10000.0, 2 * DIM, DEVICE).to(torch.float64)
    expected = torch.einsum("bhic,bhjc,ijc->bhij", q, k, (distance[..., None] * theta).cos())
    torch.testing.assert_close(ours[0] @ ours[1].transpose(-1, -2), expected, atol=1e-12, rtol=0)


@pytest.mark.device
def test_an_odd_head_dim_runs_and_decodes_as_the_full_pass():
    """PoPE pairs no features (one frequency each), so head_dim may be odd; its 2d-wide keys through a cache give
    the full pass's logits."""
    model = tiny_model("pope", dtype=torch.float64, hidden_size=36, head_dim=9)
    ids = tokens(2, 10)
    full = model(ids, use_cache=False).logits
    torch.testing.assert_close(decode_in_chunks(model, ids, [4, 1, 5]), full, atol=1e-10, rtol=0)


def test_phase_offsets_start_at_zero_or_uniform_in_their_clamp():
    """A new model's offsets: all 0, or spread over [-2 pi, 0] (x-transformers' `polar_bias_uniform_init`)."""
    for init, low, high in [("zero", 0.0, 0.0), ("uniform", -2 * math.pi, 0.0)]:
        model = new_model(tiny_config("pope", pope_bias_init=init))
        offsets = torch.stack([layer.positional.phase_bias for layer in model.model.layers])
        assert offsets.min() >= low and offsets.max() <= high
        assert (offsets.std() > 1) == (init == "uniform")


@pytest.mark.parametrize("law", [law for law in LAWS if law != "compiles"])
def test_shared_phase_offsets_obey_every_law(law):
    LAWS[law](Subject("pope", DEVICE, WEIGHT_STD, {"pope_shared_bias": True}))


def test_shared_phase_offsets_are_one_set_that_every_layer_reads():
    """`pope_shared_bias`: one (heads, head_dim) parameter at the model level, as x-transformers' one
    `PolarEmbedding`; the model computes, forward and backward, the per-layer model whose every layer holds it."""
    shared = tiny_model(
        "pope", dtype=torch.float64, pope_shared_bias=True, pope_bias_init="uniform", num_hidden_layers=3
    )
    offsets = shared.model.positional.phase_bias
    assert offsets.shape == (4, 8) and all(layer.positional.phase_bias is None for layer in shared.model.layers)
    own = tiny_model("pope", dtype=torch.float64, num_hidden_layers=3)
    state = {k: v for k, v in shared.state_dict().items() if k != "model.positional.phase_bias"}
    state.update({f"model.layers.{i}.positional.phase_bias": offsets.detach() for i in range(3)})
    own.load_state_dict(state)
    ids = tokens(2, 10)
    torch.testing.assert_close(shared(ids).logits, own(ids).logits, atol=1e-12, rtol=0)
    shared(ids).logits.sum().backward()
    own(ids).logits.sum().backward()
    summed = sum(layer.positional.phase_bias.grad for layer in own.model.layers)
    torch.testing.assert_close(offsets.grad, summed, atol=1e-10, rtol=0)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"pope_bias_init": "normal"}, "pope_bias_init='normal' is not allowed; choose one of: zero, uniform"),
        ({"pope_shared_bias": 1}, "pope_shared_bias=1 is not allowed; it must be True or False"),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
            "rope_type='linear' is not allowed with pe_type='pope'",
        ),
    ],
)
def test_bad_values_name_the_field(options, message):
    """A one-line ValueError naming the field and what is allowed."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        TapeConfig(pe_type="pope", **options)
