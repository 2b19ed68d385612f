"""Stick-breaking attention (`pe_type="stickbreaking"`): tapelm's plain PyTorch reference against fla's naive op
(outputs and the gradients of q, k, v; the whole model's logits and parameter gradients), the special cases the
paper states (saturated sticks attend to the nearest visible key, closed ones to nothing, weights sum to at most 1),
the mask's meaning (padding, packed documents) and the user paths where they differ from the shared law tests."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import DynamicCache

from conftest import DEVICE, decode_in_chunks, tiny_config, tiny_model, tokens
from tapelm import fast_paths
from tapelm.fast_paths import NONE
from tapelm.kernels.attention import AttentionMask
from tapelm.kernels.stickbreaking_attention import stickbreaking_attention
from tapelm.kernels.stickbreaking_attention.naive import visible_keys

pytestmark = pytest.mark.device


def fla_naive():
    return pytest.importorskip(
        "fla.ops.stickbreaking_attn.naive", reason="fla is not installed (pip install tapelm[gpu])"
    ).naive_stickbreaking_attn


def qkv(batch=2, heads=4, kv_heads=2, length=9, width=8, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)

    def draw(h):
        return (
            torch.randn(batch, h, length, width, generator=generator, dtype=dtype, device="cpu")
            .to(DEVICE)
            .requires_grad_()
        )

    return draw(heads), draw(kv_heads), draw(kv_heads)


LEAN = frozenset({"stickbreaking-attention-autograd"})


def attention(q, k, v, mask=None, attend_current=False, scale=None, paths=NONE):
    """tapelm's reference (or the fast paths in `paths`), output only."""
    mask = mask if mask is not None else AttentionMask(None, True)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return stickbreaking_attention(q, k, v, mask, scale, attend_current, paths)[0]


def weights(q, k, v, mask=None, attend_current=False, scale=None):
    mask = mask if mask is not None else AttentionMask(None, True)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return stickbreaking_attention(q, k, v, mask, scale, attend_current, NONE, weights=True)[1]


@pytest.mark.parametrize("attend_current", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_the_reference_equals_flas_naive_op_with_every_gradient(attend_current, kv_heads):
    naive = fla_naive()
    q, k, v = qkv(kv_heads=kv_heads)
    ours = attention(q, k, v, attend_current=attend_current, scale=0.4)
    theirs, _ = naive(*(x.transpose(1, 2) for x in (q, k, v)), scale=0.4, attend_current=attend_current)
    theirs = theirs.transpose(1, 2)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-13)
    cotangent = torch.randn_like(ours)
    ours_grads = torch.autograd.grad(ours, (q, k, v), cotangent)
    theirs_grads = torch.autograd.grad(theirs, (q, k, v), cotangent)
    for name, a, b in zip("qkv", ours_grads, theirs_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12, msg=name)


@pytest.mark.parametrize("attend_current", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("masked", [False, True])
def test_the_autograd_function_computes_the_reference_and_its_gradients(attend_current, kv_heads, masked):
    """The fast path "stickbreaking-attention-autograd" (fewer passes, in place; the weights recomputed in the
    backward pass) against the reference: output and the gradients of q, k, v, under a plain causal mask and under
    padding and packed documents."""
    q, k, v = qkv(kv_heads=kv_heads, length=7)
    mask = padded_and_packed_mask() if masked else AttentionMask(None, True)
    expected = stickbreaking_attention(q, k, v, mask, 0.4, attend_current, NONE)[0]
    with fast_paths.recording() as ran:
        got = stickbreaking_attention(q, k, v, mask, 0.4, attend_current, LEAN)[0]
    assert ran == {"stickbreaking-attention-autograd"}
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-14)
    cotangent = torch.randn(
        expected.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64, device="cpu"
    )
    cotangent = cotangent.to(DEVICE)
    expected_grads = torch.autograd.grad(expected, (q, k, v), cotangent)
    got_grads = torch.autograd.grad(got, (q, k, v), cotangent)
    for name, a, b in zip("qkv", got_grads, expected_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13, msg=name)


def through_flas_naive_op(model):
    """`model` with each layer's attention computed by fla's naive op through the layer's hook (no cache, no
    padding: the op takes whole causal sequences)."""
    naive = fla_naive()
    current = model.config.stickbreaking_attend_current

    def attend(self, q, k, stream, shared, mask, scale, ctx, probabilities=False):
        assert shared is None and mask.valid is None and mask.is_causal
        out, _ = naive(*(x.transpose(1, 2) for x in (q, k, stream)), scale=scale, attend_current=current)
        return out.transpose(1, 2), None

    for layer in model.model.layers:
        layer.positional.attend = types.MethodType(attend, layer.positional)
    return model


@pytest.mark.parametrize("attend_current", [False, True])
def test_the_model_equals_one_whose_attention_is_flas_naive_op(attend_current):
    """Logits and every parameter's gradient of the whole model (GQA: 4 heads, 2 KV heads)."""
    ids = tokens(2, 11)
    ours = tiny_model("stickbreaking", dtype=torch.float64, stickbreaking_attend_current=attend_current)
    theirs = through_flas_naive_op(
        tiny_model("stickbreaking", dtype=torch.float64, stickbreaking_attend_current=attend_current)
    )
    expected, got = theirs(ids).logits, ours(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-11, atol=1e-12)
    expected.square().sum().backward()
    got.square().sum().backward()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)


def saturated(sign: float, length=7):
    """q . k = sign * 400 for every pair (z = +-100 at scale 1/4): each stick breaks wholly at the first key it meets,
    or not at all."""
    q = torch.ones(1, 2, length, 16, dtype=torch.float64, device=DEVICE) * 5
    k = torch.ones(1, 1, length, 16, dtype=torch.float64, device=DEVICE) * 5 * sign
    v = torch.randn(1, 1, length, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1), device="cpu").to(
        DEVICE
    )
    return q, k, v


def nearest_visible(visible: torch.Tensor) -> torch.Tensor:
    """(…, N, T) one-hot of the last visible key of each row (zero where a row sees none)."""
    index = torch.arange(visible.shape[-1], device=visible.device)
    last = torch.where(visible, index, -1).amax(-1, keepdim=True)
    return (index == last) & visible


def padded_and_packed_mask(length=7):
    """Row 0 left-padded by 2 (each padding token sees only itself), row 1 two documents of 3 and 4 tokens."""
    causal = torch.ones(length, length, dtype=torch.bool, device=DEVICE).tril()
    padded = causal.clone()
    padded[2:, :2] = False
    padded[:2] = torch.eye(length, dtype=torch.bool, device=DEVICE)[:2]
    packed = (
        causal
        & torch.block_diag(torch.ones(3, 3, device=DEVICE), torch.ones(length - 3, length - 3, device=DEVICE)).bool()
    )
    return AttentionMask(torch.stack([padded, packed])[:, None], False)


@pytest.mark.parametrize("paths", [NONE, LEAN], ids=["reference", "autograd"])
@pytest.mark.parametrize("attend_current", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_saturated_sticks_attend_to_the_nearest_visible_key_and_closed_ones_to_nothing(attend_current, masked, paths):
    q, k, v = saturated(1.0)
    mask = padded_and_packed_mask() if masked else AttentionMask(None, True)
    if masked:
        q, k, v = (x.expand(2, -1, -1, -1) for x in (q, k, v))
    visible = visible_keys(mask, 7, 7, attend_current, DEVICE)
    one_hot = nearest_visible(visible).to(v.dtype).expand(q.shape[0], 1, -1, -1)
    expected = (one_hot @ v).expand(-1, 2, -1, -1)
    torch.testing.assert_close(attention(q, k, v, mask, attend_current, 0.25, paths), expected, rtol=0, atol=1e-30)
    if not attend_current:  # the first token of a sequence sees no key but its own
        assert (expected[..., 0, :] == 0).all()
    q, k, v = saturated(-1.0)
    if masked:
        q, k, v = (x.expand(2, -1, -1, -1) for x in (q, k, v))
    assert attention(q, k, v, mask, attend_current, 0.25, paths).abs().max() < 1e-40


@pytest.mark.parametrize("attend_current", [False, True])
def test_the_weights_are_nonnegative_sum_to_at_most_one_and_match_the_product_formula(attend_current):
    """A_ij = sigmoid(z_ij) prod_{j<l<i} (1 - sigmoid(z_il)) (l <= i with attend_current), written out directly;
    the stick left over is 1 - sum_j A_ij >= 0."""
    q, k, v = qkv(batch=1, heads=2, kv_heads=1, length=6, seed=3)
    got = weights(q * 3, k, v, attend_current=attend_current).detach()
    z = (q * 3 @ k.transpose(-1, -2)).detach() * 8**-0.5
    expected = torch.zeros_like(z)
    for i in range(6):
        last = i if attend_current else i - 1
        for j in range(last + 1):
            expected[..., i, j] = z[..., i, j].sigmoid() * (1 - z[..., i, j + 1 : last + 1].sigmoid()).prod(-1)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    assert (got >= 0).all() and (got.sum(-1) <= 1 + 1e-12).all()


def test_output_attentions_returns_the_weights_the_output_mixed():
    model = tiny_model("stickbreaking", dtype=torch.float64)
    ids = tokens(2, 8)
    out = model(ids, output_attentions=True)
    torch.testing.assert_close(out.logits, model(ids).logits, rtol=0, atol=1e-12)
    for probs in out.attentions:
        assert probs.shape == (2, 4, 8, 8)
        assert (probs.triu(0) == 0).all() and (probs.sum(-1) <= 1 + 1e-12).all()
        assert (probs[..., 0, :] == 0).all()  # the first token sees nothing but itself


def test_padding_and_cached_continuation_compute_what_each_row_computes_alone():
    """Left padding: the real tokens' logits and the next token's through the cache equal the unpadded row's."""
    model = tiny_model("stickbreaking", dtype=torch.float64)
    short, long = tokens(1, 5, seed=1), tokens(1, 8, seed=2)
    ids = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long, device=DEVICE), short], 1), long])
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    cache = DynamicCache(config=model.config)
    logits = model(ids, attention_mask=mask, cache=cache, use_cache=True).logits
    torch.testing.assert_close(logits[0, 3:], model(short).logits[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(logits[1], model(long).logits[0], rtol=0, atol=1e-12)
    nxt = tokens(2, 1, seed=4)
    step = model(nxt, attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1), cache=cache, use_cache=True).logits
    torch.testing.assert_close(step[0], model(torch.cat([short, nxt[:1]], 1)).logits[0, -1:], rtol=0, atol=1e-12)
    torch.testing.assert_close(step[1], model(torch.cat([long, nxt[1:]], 1)).logits[0, -1:], rtol=0, atol=1e-12)


@pytest.mark.parametrize("attend_current", [False, True])
def test_cached_and_static_cache_generation_equal_uncached(attend_current):
    model = tiny_model("stickbreaking", dtype=torch.float64, stickbreaking_attend_current=attend_current)
    ids = tokens(2, 9)
    full = model(ids).logits
    torch.testing.assert_close(decode_in_chunks(model, ids, [4, 1, 1, 3]), full, rtol=0, atol=1e-12)
    prompt, kwargs = ids[:, :4], dict(max_new_tokens=6, do_sample=False)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(model.generate(prompt, **kwargs), uncached)
    assert torch.equal(model.generate(prompt, cache_implementation="static", **kwargs), uncached)


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="stickbreaking_attend_current"):
        tiny_config("stickbreaking", stickbreaking_attend_current="yes")
    with pytest.raises(ValueError, match="causal=False"):
        tiny_config("stickbreaking", causal=False)


@pytest.mark.compiles
def test_compiled_layers_train_as_eager_code_does():
    """`compile_layers()` (AOTAutograd tracing the autograd path's forward and backward) gives eager gradients."""
    ids = tokens(2, 12)
    eager, compiled = tiny_model("stickbreaking").train(), tiny_model("stickbreaking").train()
    compiled.compile_layers(backend="aot_eager")
    for model in (eager, compiled):
        model(ids, labels=ids, use_cache=False).loss.backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
