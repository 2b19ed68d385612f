"""The contextual peers FoX, PaTH and Wall: their own laws, beyond the ones every encoding passes (Wall's reference
and special cases are in test_wall.py)."""

import pytest
import torch
from transformers import DynamicCache

from conftest import DEVICE, tiny_model, tokens
from tapelm import TapeConfig
from tapelm.fast_paths import NONE
from tapelm.kernels.path_attention import path_logits
from tapelm.positional import PositionContext
from test_cache import decode_in_chunks

pytestmark = pytest.mark.device

VALID = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def copy_into(source, target) -> None:
    """Load source's weights into target; target may only lack or add positional parameters."""
    missing, unexpected = target.load_state_dict(source.state_dict(), strict=False)
    assert all(".positional." in name for name in missing + unexpected)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(pe_type="fox", causal=False), "causal"),
        (dict(pe_type="path", causal=False), "causal"),
        (dict(path_low_rank=-1), "path_low_rank"),
        (dict(path_low_rank=2.5), "path_low_rank"),
        (dict(path_conv_size=0), "path_conv_size"),
        (dict(fox_gate_bias_init=float("nan")), "fox_gate_bias_init"),
        (dict(pe_type="wall", causal=False), "causal"),
        (dict(wall_gate_bias_init=float("inf")), "wall_gate_bias_init"),
        (dict(wall_gate_bias_init="8"), "wall_gate_bias_init"),
    ],
)
def test_invalid_peer_options_are_named(overrides, field):
    with pytest.raises(ValueError, match=field):
        TapeConfig(**{**VALID, **overrides})


# --- FoX ---------------------------------------------------------------------------------------------------------


def saturate_gates(model, value: float) -> None:
    with torch.no_grad():
        for layer in model.model.layers:
            layer.positional.gate.weight.zero_()
            layer.positional.gate.bias.fill_(value)


def test_fox_with_open_gates_is_nope():
    """f = 1 everywhere: no bias, so FoX computes what NoPE computes with the same weights."""
    fox = tiny_model("fox", dtype=torch.float64, num_hidden_layers=3)
    nope = tiny_model("nope", dtype=torch.float64, num_hidden_layers=3, seed=1)
    copy_into(fox, nope)
    ids = tokens(2, 20)
    assert not torch.allclose(fox(ids).logits, nope(ids).logits)
    saturate_gates(fox, 1e9)  # logsigmoid(1e9) == 0 exactly
    torch.testing.assert_close(fox(ids).logits, nope(ids).logits, atol=1e-12, rtol=0)


def test_fox_bias_is_the_double_sum_of_log_gates():
    model = tiny_model("fox", dtype=torch.float64)
    layer = model.model.layers[1].positional
    batch, length, heads, dim = 2, 9, 4, 8
    x = randn(batch, length, 32, generator=torch.Generator().manual_seed(3))
    q, k = (torch.zeros(batch, h, length, dim, dtype=torch.float64, device=DEVICE) for h in (heads, 2))
    ctx = PositionContext(paths=NONE, query_positions=torch.arange(length, device=DEVICE).expand(batch, -1))
    bias = layer.attention_inputs(x, q, k, k, dim, None, 1, None, ctx)[3].full()
    f = torch.sigmoid(x @ layer.gate.weight.T + layer.gate.bias)  # (B, N, H)
    for i in range(length):
        for j in range(i + 1):
            expected = sum(
                (torch.log(f[:, s]) for s in range(j + 1, i + 1)),
                torch.zeros(batch, heads, dtype=torch.float64, device=DEVICE),
            )
            torch.testing.assert_close(bias[:, :, i, j], expected, atol=1e-12, rtol=0)
    assert (bias[:, :, 5, 2] < 0).all()


def test_fox_keeps_cumulative_gates_in_float32_in_a_bf16_cache():
    model = tiny_model("fox", dtype=torch.bfloat16)
    out = model(tokens(1, 6), use_cache=True)
    states = [layer.state("forget") for layer in out.cache.layers]
    assert len(states) == model.config.num_hidden_layers
    assert all(state.dtype == torch.float32 and state.shape == (1, 4, 6, 1) for state in states)


# --- PaTH --------------------------------------------------------------------------------------------------------


def naive_transform(w, beta, k, i, j):
    """H_i ... H_{j+1} k, with H_s = I - beta_s w_s w_s^T, as explicit matrices (one head)."""
    product = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    for s in range(j + 1, i + 1):
        product = (torch.eye(k.shape[-1], dtype=k.dtype, device=k.device) - beta[s] * torch.outer(w[s], w[s])) @ product
    return product @ k


def randn(*shape, generator) -> torch.Tensor:
    """float64 normal noise drawn on the CPU (the same on every device), on the test device."""
    return torch.randn(*shape, dtype=torch.float64, generator=generator, device="cpu").to(DEVICE)


def random_inputs(batch, kv_heads, groups, length, dim, seed, beta=None):
    g = torch.Generator().manual_seed(seed)
    q = randn(batch, kv_heads, groups, length, dim, generator=g)
    k = randn(batch, kv_heads, length, dim, generator=g)
    w = torch.nn.functional.normalize(randn(batch, kv_heads, length, dim, generator=g), dim=-1)
    if beta is None:
        beta = 2 * torch.rand(batch, kv_heads, length, dtype=torch.float64, generator=g, device="cpu").to(DEVICE)
    else:
        beta = torch.full((batch, kv_heads, length), float(beta), dtype=torch.float64, device=DEVICE)
    return q, k, w, beta


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("past", [0, 5])
def test_path_logits_equal_explicit_householder_products(chunk, past):
    """The chunked UT computation equals q_i^T H_i ... H_{j+1} k_j built from explicit matrices, in float64, with
    and without cached keys (which arrive already transformed up to the last cached token)."""
    batch, kv_heads, groups, length, dim = 2, 2, 2, 11, 4
    q, k, w, beta = random_inputs(batch, kv_heads, groups, past + length, dim, seed=chunk + past)
    cached = None
    if past:
        cached = torch.stack(
            [
                torch.stack(
                    [
                        torch.stack(
                            [naive_transform(w[b, h], beta[b, h], k[b, h, j], past - 1, j) for j in range(past)]
                        )
                        for h in range(kv_heads)
                    ]
                )
                for b in range(batch)
            ]
        )
    new = slice(past, past + length)
    logits, keys = path_logits(q[..., new, :], k[:, :, new], w[:, :, new], beta[:, :, new], cached, chunk=chunk)
    assert logits.shape == (batch, kv_heads, groups, length, past + length)
    for b in range(batch):
        for h in range(kv_heads):
            for i in range(past, past + length):
                for j in range(past + length):
                    expected = 0.0
                    if j <= i:
                        expected = q[b, h, :, i] @ naive_transform(w[b, h], beta[b, h], k[b, h, j], i, j)
                    torch.testing.assert_close(
                        logits[b, h, :, i - past, j],
                        torch.as_tensor(expected, dtype=torch.float64, device=DEVICE).expand(groups),
                        atol=1e-12,
                        rtol=0,
                    )
            for j in range(past + length):
                last = past + length - 1
                torch.testing.assert_close(
                    keys[b, h, j], naive_transform(w[b, h], beta[b, h], k[b, h, j], last, j), atol=1e-12, rtol=0
                )


def test_path_with_beta_two_is_orthogonal():
    """beta = 2 makes every H an exact reflection: carried keys keep their norms, and products stay orthogonal."""
    q, k, w, beta = random_inputs(1, 2, 1, 20, 6, seed=7, beta=2.0)
    _, keys = path_logits(q, k, w, beta, chunk=8)
    torch.testing.assert_close(keys.norm(dim=-1), k.norm(dim=-1), atol=1e-12, rtol=0)
    assert not torch.allclose(keys, k)
    basis = torch.eye(6, dtype=torch.float64, device=DEVICE)
    product = torch.stack([naive_transform(w[0, 0], beta[0, 0], basis[c], 19, 0) for c in range(6)], dim=-1)
    torch.testing.assert_close(product.T @ product, basis, atol=1e-12, rtol=0)


def set_beta(model, value: float) -> None:
    with torch.no_grad():
        for layer in model.model.layers:
            layer.positional.beta_proj.weight.zero_()
            layer.positional.beta_proj.bias.fill_(value)


def test_path_with_beta_zero_is_nope():
    path = tiny_model("path", dtype=torch.float64, num_hidden_layers=3)
    nope = tiny_model("nope", dtype=torch.float64, num_hidden_layers=3, seed=1)
    copy_into(path, nope)
    ids = tokens(2, 20)
    assert not torch.allclose(path(ids).logits, nope(ids).logits)
    set_beta(path, -1e9)  # 2 sigmoid(-1e9) == 0 exactly: every H is the identity
    torch.testing.assert_close(path(ids).logits, nope(ids).logits, atol=1e-12, rtol=0)


def test_path_cache_holds_keys_transformed_up_to_the_last_token():
    model = tiny_model("path", dtype=torch.float64, num_hidden_layers=1)
    ids = tokens(1, 7)
    cache = model(ids, use_cache=True).cache
    layer = model.model.layers[0]
    raw = {}
    hook = layer.self_attn.k_proj.register_forward_hook(lambda mod, args, out: raw.update(k=out))
    x = {}
    norm_hook = layer.input_layernorm.register_forward_hook(lambda mod, args, out: x.update(x=out))
    model(ids, use_cache=False)
    hook.remove()
    norm_hook.remove()
    ctx = PositionContext(paths=NONE, query_positions=torch.arange(7, device=DEVICE)[None])
    w, beta = layer.positional.householder(x["x"], ctx, None)
    k = raw["k"].view(1, 7, 2, 8).transpose(1, 2)
    for h in range(2):
        for j in range(7):
            torch.testing.assert_close(
                cache.layers[0].keys[0, h, j],
                naive_transform(w[0, h], beta[0, h], k[0, h, j], 6, j),
                atol=1e-12,
                rtol=0,
            )


@pytest.mark.parametrize(
    "overrides", [dict(path_low_rank=0), dict(path_conv_size=1), dict(path_conv_size=4), dict(num_key_value_heads=4)]
)
def test_path_options_keep_cache_parity(overrides):
    model = tiny_model("path", dtype=torch.float64, num_hidden_layers=2, **overrides)
    ids = tokens(2, 12)
    full = model(ids, use_cache=False).logits
    torch.testing.assert_close(decode_in_chunks(model, ids, [1] * 12), full, atol=1e-10, rtol=0)
    torch.testing.assert_close(decode_in_chunks(model, ids, [5, 1, 2, 4]), full, atol=1e-10, rtol=0)


def test_path_chunks_longer_than_one_block_keep_cache_parity():
    """More tokens than one 64-token chunk, in one call and then token by token."""
    model = tiny_model("path", dtype=torch.float64, num_hidden_layers=1, max_position_embeddings=256)
    ids = tokens(1, 150)
    full = model(ids, use_cache=False).logits
    torch.testing.assert_close(decode_in_chunks(model, ids, [70, 1, 1, 78]), full, atol=1e-9, rtol=0)


# --- all ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pe_type", ["fox", "path", "wall"])
def test_output_attentions(pe_type):
    model = tiny_model(pe_type, dtype=torch.float64)
    ids = tokens(2, 10)
    out = model(ids, output_attentions=True)
    torch.testing.assert_close(out.logits, model(ids).logits, atol=1e-12, rtol=0)
    assert len(out.attentions) == model.config.num_hidden_layers
    for probs in out.attentions:
        assert probs.shape == (2, 4, 10, 10)
        torch.testing.assert_close(
            probs.sum(-1), torch.ones(2, 4, 10, dtype=torch.float64, device=DEVICE), atol=1e-12, rtol=0
        )
        assert (probs.triu(1) == 0).all()


@pytest.mark.parametrize("pe_type", ["fox", "path", "wall"])
def test_beam_search_reorders_the_per_layer_state(pe_type):
    model = tiny_model(pe_type, dtype=torch.float64)
    ids = tokens(2, 6)
    kwargs = dict(max_new_tokens=8, do_sample=False, num_beams=3)
    assert torch.equal(model.generate(ids, use_cache=True, **kwargs), model.generate(ids, use_cache=False, **kwargs))


@pytest.mark.parametrize("pe_type", ["fox", "path", "wall"])
def test_padding_tokens_do_not_leak_into_state(pe_type):
    """Whatever the padding tokens are, the real tokens' outputs and the continuation stay the same."""
    model = tiny_model(pe_type, dtype=torch.float64)
    short = tokens(1, 7, seed=2)
    mask = torch.cat(
        [torch.zeros(1, 4, dtype=torch.long, device=DEVICE), torch.ones(1, 7, dtype=torch.long, device=DEVICE)], dim=1
    )
    results = []
    for pad in (0, 17):
        batch = torch.cat([torch.full((1, 4), pad, device=DEVICE), short], dim=1)
        cache = DynamicCache(config=model.config)
        first = model(batch, attention_mask=mask, cache=cache, use_cache=True).logits[:, 4:]
        nxt = model(
            tokens(1, 1, seed=5), attention_mask=torch.cat([mask, mask[:, -1:]], 1), cache=cache, use_cache=True
        ).logits
        results.append(torch.cat([first, nxt], dim=1))
    torch.testing.assert_close(results[0], results[1], atol=1e-12, rtol=0)
