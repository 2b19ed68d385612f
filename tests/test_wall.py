"""Wall attention ("wall"): tapelm's reference against fla's `naive_wall_attn` (outputs and the gradients of q, k, v
and the log gates; GQA; packed segments; a whole attention block with the same weights), and its special cases:
gates equal over a head's channels scale the logits by FoX's decay, open channel gates with the scalar gate are FoX,
open gates are NoPE, closed gates over long contexts stay finite.
The reference runs a block of queries at a time: the tests use blocks shorter than their sequences.

fla's naive op sums the gates with fla's Triton `chunk_global_cumsum`, which does not run on the CPU; on the CPU the
tests give it `torch.cumsum` restarted at each segment (the function fla's kernel computes) in its place. fla's naive
op computes in float32 whatever it is given, so the float64 tapelm reference is held to float32's accuracy there."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from accuracy import BATCHES, batch_inputs, compare_paths, outputs
from conftest import DEVICE, WEIGHT_STD, decode_in_chunks, new_model, tiny_config, tiny_model, tokens
from tapelm import fast_paths
from tapelm.kernels.attention import AttentionMask
from tapelm.kernels.forgetting_attention.naive import forgetting_bias
from tapelm.kernels.wall_attention import naive
from tapelm.kernels.wall_attention.naive import Gates, wall_attention
from test_peers import copy_into

pytestmark = pytest.mark.device

FLA_TOLERANCE = 2e-5
"""Largest error against fla's naive op, as a fraction of the largest entry (it rounds to float32)."""


@pytest.fixture
def fla_naive(monkeypatch):
    """fla's `naive_wall_attn`, its prefix sums by `torch.cumsum` on the CPU."""
    module = pytest.importorskip("fla.ops.wall_attn.naive", reason="fla is not installed (pip install tapelm[gpu])")
    if DEVICE.type != "cuda":

        def cumsum(x, cu_seqlens=None, scale=1.0):
            if cu_seqlens is None:
                return x.cumsum(1) * scale
            bounds = cu_seqlens.tolist()
            return torch.cat([x[:, a:b].cumsum(1) for a, b in zip(bounds[:-1], bounds[1:])], dim=1) * scale

        monkeypatch.setattr(module, "chunk_global_cumsum", cumsum)
    return module.naive_wall_attn


@pytest.fixture
def short_blocks(monkeypatch):
    monkeypatch.setattr(naive, "BLOCK", 5)


def randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (
        (scale * torch.randn(shape, generator=generator, dtype=torch.float64, device="cpu")).to(DEVICE).requires_grad_()
    )


def close(got: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    torch.testing.assert_close(got, expected.to(got.dtype), atol=tolerance * expected.abs().max().item(), rtol=0)


def heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def segment_mask(bounds: list[int]) -> AttentionMask:
    """The causal mask of packed documents with these cumulative lengths, in one row."""
    length, cuts = bounds[-1], torch.tensor(bounds, device=DEVICE)
    document = torch.repeat_interleave(torch.arange(len(bounds) - 1, device=DEVICE), cuts[1:] - cuts[:-1])
    valid = (document[:, None] == document[None, :]) & torch.ones(
        length, length, dtype=torch.bool, device=DEVICE
    ).tril()
    return AttentionMask(valid[None, None], False)


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("bounds", [None, [0, 7, 8, 23, 30]])
def test_the_reference_equals_flas_naive_op(fla_naive, short_blocks, kv_heads, bounds, scalar):
    """Outputs and the gradients of q, k, v and the log gates, with GQA, packed segments (fla's `cu_seqlens`) and
    the scalar gate (fla's `g_scalar`)."""
    batch, length, heads, dim = (1, 30, 4, 8) if bounds else (2, 23, 4, 8)
    q = randn(batch, length, heads, dim, seed=1)
    k = randn(batch, length, kv_heads, dim, seed=2)
    v = randn(batch, length, kv_heads, 6, seed=3)
    log_g = F.logsigmoid(randn(batch, length, heads, dim, seed=4, scale=2.0).detach()).requires_grad_()
    log_f = F.logsigmoid(randn(batch, length, heads, seed=6, scale=2.0).detach()).requires_grad_() if scalar else None
    cuts = None if bounds is None else torch.tensor(bounds, device=DEVICE)
    expected = fla_naive(q, k, v, log_g, scale=dim**-0.5, cu_seqlens=cuts, g_scalar=log_f)
    mask = AttentionMask(None, True) if bounds is None else segment_mask(bounds)
    gates = (heads_first(log_g), heads_first(log_g).cumsum(-2))
    if scalar:
        gates += (heads_first(log_f)[..., None], heads_first(log_f)[..., None].cumsum(-2))
    got = heads_first(wall_attention(heads_first(q), heads_first(k), heads_first(v), Gates(*gates), mask, dim**-0.5)[0])
    close(got, expected, FLA_TOLERANCE)
    weights = randn(*expected.shape, seed=5).detach()
    inputs = (q, k, v, log_g, log_f) if scalar else (q, k, v, log_g)
    grads = torch.autograd.grad((got * weights).sum(), inputs)
    for a, b in zip(grads, torch.autograd.grad((expected * weights.float()).sum(), inputs), strict=True):
        close(a, b, FLA_TOLERANCE)


@pytest.mark.parametrize("scalar", [False, True])
def test_an_attention_block_equals_flas_naive_op_with_the_same_weights(fla_naive, short_blocks, scalar):
    """A layer's attention output (projections, gates, attention, output projection) and its parameters' gradients,
    against the same weights through fla's naive op as fla's `WallAttention` calls it."""
    model = tiny_model("wall", dtype=torch.float64, wall_scalar_gate=scalar)
    layer = model.model.layers[0]
    attn, x = layer.self_attn, randn(2, 17, 32, seed=7).detach()
    captured = {}
    attn.register_forward_hook(lambda module, args, out: captured.update(out=out[0]))
    layer.input_layernorm.register_forward_hook(lambda module, args, out: captured.update(x=out))
    model.model(inputs_embeds=x)
    normed, got = captured["x"], captured["out"]
    split = (2, 17, -1, 8)
    q, k, v = (proj(normed).view(split) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    log_g = F.logsigmoid(layer.positional.gate(normed)).view(split)
    log_f = F.logsigmoid(layer.positional.scalar_gate(normed)) if scalar else None
    expected = attn.o_proj(fla_naive(q, k, v, log_g, scale=8**-0.5, g_scalar=log_f).flatten(2).to(normed.dtype))
    close(got, expected, FLA_TOLERANCE)
    weights = randn(*got.shape, seed=8).detach()
    parameters = [*attn.parameters(), *layer.positional.parameters()]
    grads = torch.autograd.grad((got * weights).sum(), parameters, retain_graph=True)
    for a, b in zip(grads, torch.autograd.grad((expected * weights).sum(), parameters), strict=True):
        close(a, b, FLA_TOLERANCE)


def test_equal_gates_over_a_heads_channels_scale_each_logit_by_foxs_decay(short_blocks):
    """log g the same in every channel of a head: Wall's logit is scale q.k exp(c_i - c_j), c_i - c_j FoX's bias
    (tapelm's FoX kernel reference) with that gate: FoX's decay multiplies the logit where FoX adds its log.
    Outputs and gradients, queries after cached keys included: 4 (blocks that share anchored chunks) and 1 (a
    decoding step, past a whole chunk of 16, which reads every key directly)."""
    batch, heads, length, dim = 2, 4, 19, 8
    q, k = randn(batch, heads, length, dim, seed=1), randn(batch, 2, length, dim, seed=2)
    v = randn(batch, 2, length, 5, seed=3)
    log_f = F.logsigmoid(randn(batch, heads, length, 1, seed=4).detach()).requires_grad_()
    cumulative = log_f.cumsum(-2)
    for queries in (length, 4, 1):
        causal = torch.ones(queries, length, dtype=torch.bool, device=DEVICE).tril(length - queries)
        gates = Gates(log_f[..., -queries:, :].expand(-1, -1, -1, dim), cumulative.expand(-1, -1, -1, dim))
        got = wall_attention(q[..., -queries:, :], k, v, gates, AttentionMask(causal[None, None], False), 0.5)[0]
        decay = forgetting_bias(cumulative[..., -queries:, :], cumulative.mT, q.dtype).full().exp()
        logits = (q[..., -queries:, :] @ k.repeat_interleave(2, dim=1).mT) * 0.5 * decay
        expected = logits.masked_fill(~causal, -math.inf).softmax(-1) @ v.repeat_interleave(2, dim=1)
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
        for a, b in zip(
            torch.autograd.grad(got.square().sum(), (q, k, v, log_f)),
            torch.autograd.grad(expected.square().sum(), (q, k, v, log_f)),
            strict=True,
        ):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def open_channel_gates(model) -> None:
    """g = 1 in every channel: logsigmoid of a huge bias is exactly 0."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.positional.gate.weight.zero_()
            layer.positional.gate.bias.fill_(1e9)


def test_open_channel_gates_with_the_scalar_gate_are_fox():
    """The channel gates open, the scalar gate FoX's forget gate with the same weights: Wall computes FoX's logits
    and gradients."""
    wall = tiny_model("wall", dtype=torch.float64, wall_scalar_gate=True)
    fox = tiny_model("fox", dtype=torch.float64, seed=1)
    shared = {name: weight for name, weight in wall.state_dict().items() if ".positional." not in name}
    assert fox.load_state_dict(shared, strict=False).unexpected_keys == []
    open_channel_gates(wall)
    ids = tokens(2, 40)
    assert not torch.allclose(wall(ids).logits, fox(ids).logits)
    with torch.no_grad():
        for wall_layer, fox_layer in zip(wall.model.layers, fox.model.layers, strict=True):
            fox_layer.positional.gate.weight.copy_(wall_layer.positional.scalar_gate.weight)
            fox_layer.positional.gate.bias.copy_(wall_layer.positional.scalar_gate.bias)
    got, expected = wall(ids).logits, fox(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    got.square().sum().backward()
    expected.square().sum().backward()
    walls = dict(wall.named_parameters())
    for name, a in fox.named_parameters():
        b = walls[name.replace("positional.gate", "positional.scalar_gate")]
        torch.testing.assert_close(b.grad, a.grad, atol=1e-10, rtol=1e-9, msg=name)


def test_open_gates_are_nope():
    """g = 1 in every channel (logsigmoid of a huge bias is exactly 0): Wall computes what NoPE computes with the
    same weights."""
    wall = tiny_model("wall", dtype=torch.float64, num_hidden_layers=3)
    nope = tiny_model("nope", dtype=torch.float64, num_hidden_layers=3, seed=1)
    copy_into(wall, nope)
    ids = tokens(2, 40)
    assert not torch.allclose(wall(ids).logits, nope(ids).logits)
    open_channel_gates(wall)
    torch.testing.assert_close(wall(ids).logits, nope(ids).logits, atol=1e-12, rtol=0)


def test_closed_gates_over_a_long_context_stay_finite():
    """Gates of e^-30 per token over 300 tokens in float32 (cumulative sums down to -9000, where exp(-G) alone
    overflows): outputs and gradients finite and equal to the float64 computation."""
    length, dim = 300, 8
    q, k, v = (randn(1, 2, length, dim, seed=seed) for seed in (1, 2, 3))
    log_g = torch.full((1, 2, length, dim), -30.0, dtype=torch.float64, device=DEVICE)
    log_g[..., ::7, :] = -0.01
    log_g.requires_grad_()
    runs = []
    for dtype in (torch.float32, torch.float64):
        inputs = [x.to(dtype) for x in (q, k, v)]
        gates = Gates(log_g.to(dtype), log_g.to(dtype).cumsum(-2))
        out = wall_attention(*inputs, gates, AttentionMask(None, True), dim**-0.5)[0]
        runs.append((out, *torch.autograd.grad(out.sum(), (q, k, v, log_g))))
    for a, b in zip(*runs, strict=True):
        assert torch.isfinite(a).all()
        close(a, b, 1e-4)


def test_blocks_of_queries_compute_the_whole_function(monkeypatch):
    """Blocks of 3 queries against one block of all: logits and every parameter's gradient, padded and packed."""
    ids = tokens(2, 20)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    positions = torch.cat([torch.arange(9, device=DEVICE), torch.arange(11, device=DEVICE)])[None].expand(2, -1)
    runs = []
    for block in (3, 64):
        monkeypatch.setattr(naive, "BLOCK", block)
        model = tiny_model("wall", dtype=torch.float64, fast_paths="off")
        logits = model(ids, attention_mask=mask).logits[mask.bool()]
        packed = model(ids, position_ids=positions).logits
        (logits.square().sum() + packed.square().sum()).backward()
        runs.append([logits, packed, *(p.grad for p in model.parameters())])
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_cached_decoding_over_many_blocks(short_blocks):
    model = tiny_model("wall", dtype=torch.float64, fast_paths="off")
    ids = tokens(2, 33)
    full = model(ids).logits
    torch.testing.assert_close(decode_in_chunks(model, ids, [12, 1, 1, 7, 12]), full, atol=1e-12, rtol=0)


def test_the_cache_keeps_cumulative_gates_in_float32_in_a_bf16_model():
    model = tiny_model("wall", dtype=torch.bfloat16)
    out = model(tokens(1, 6), use_cache=True)
    states = [layer.state("wall") for layer in out.cache.layers]
    assert all(state.dtype == torch.float32 and state.shape == (1, 4, 6, 8) for state in states)


def test_gates_start_near_one():
    """fla's initialisation: the gate biases at `wall_gate_bias_init` (8), so log g is about -3e-4."""
    model = new_model(tiny_config("wall", wall_scalar_gate=True))
    layer = model.model.layers[0].positional
    assert layer.gate.weight.shape == (32, 32) and layer.scalar_gate.weight.shape == (4, 32)
    for gate in (layer.gate, layer.scalar_gate):
        assert torch.equal(gate.bias, torch.full_like(gate.bias, 8.0))


def trained_pass(net, ids: torch.Tensor, inputs: dict, dtype: torch.dtype):
    """The logits of one training pass of `net` and every parameter's gradient of a fixed random projection of them."""
    net.train()
    logits = net(ids, **inputs).logits
    generator = torch.Generator().manual_seed(3)
    weights = torch.randn(logits.shape, generator=generator, dtype=torch.float64, device="cpu")
    (logits * weights.to(DEVICE, dtype)).sum().backward()
    return outputs(net, logits=logits)


# --- one anchor per row (fast path "wall-attention-anchored") ----------------------------------------------------

ANCHORED = ["wall-attention-anchored"]


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("batch", BATCHES)
def test_anchored_computes_the_reference_function(batch, kv_heads, scalar):
    """Logits and every parameter's gradient with one anchor per row against the reference, plain, left-padded and
    packed, with GQA and the scalar gate: in float64 to 1e-12, in bfloat16 (the gates and the attention in float32) by
    the rounding rule; every attention call took the anchored path."""
    ids = tokens(2, 40)
    inputs = batch_inputs(batch, ids)

    def run(setting, dtype):
        paths = ANCHORED if setting == "on" else "off"
        overrides = {"num_key_value_heads": kv_heads, "wall_scalar_gate": scalar}
        return trained_pass(tiny_model("wall", dtype=dtype, fast_paths=paths, **overrides), ids, inputs, dtype)

    with fast_paths.recording() as ran:
        compare_paths(run, torch.bfloat16)
    assert ran == {"wall-attention-anchored"}


def test_anchored_decodes_what_the_reference_computes(short_blocks):
    """Chunks and single tokens over the cache (queries against more keys than themselves) with one anchor per row,
    against the reference's full pass."""
    ids = tokens(2, 33)
    with torch.no_grad():
        expected = tiny_model("wall", dtype=torch.float64, fast_paths="off")(ids).logits
        with fast_paths.recording() as ran:
            got = decode_in_chunks(tiny_model("wall", dtype=torch.float64, fast_paths=ANCHORED), ids, [12, 1, 1, 7, 12])
    assert ran == {"wall-attention-anchored"}
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_anchored_leaves_gates_that_span_too_much_to_the_reference():
    """Gates of e^-8 a token over 10 tokens span 80 > 60 in float32: the reference runs (the anchored factors could
    reach exp(80)); within the span the anchored path runs."""
    from tapelm.kernels.wall_attention.anchored import SPAN
    from tapelm.kernels.wall_attention.anchored import wall_attention as anchored

    q, k, v = (randn(1, 2, 10, 8, seed=seed).detach().float() for seed in (1, 2, 3))
    for per_token, taken in ((-8.0, False), (-5.0, True)):
        log_g = torch.full((1, 2, 10, 8), per_token, device=DEVICE)
        gates = Gates(log_g, log_g.cumsum(-2))
        assert (-9 * per_token <= SPAN[torch.float32]) == taken
        got = anchored(q, k, v, gates, AttentionMask(None, True), 8**-0.5, fast_paths.NONE)
        assert (got is not None) == taken
        if taken:
            wide = Gates(log_g.double(), log_g.double().cumsum(-2))
            expected = wall_attention(q.double(), k.double(), v.double(), wide, AttentionMask(None, True), 8**-0.5)
            close(got, expected[0], 1e-5)


# --- fla's kernels (fast path "wall-attention-fla") --------------------------------------------------------------

ON_GPU = DEVICE.type == "cuda"


def decode_stand_in(q, v, p_curr, k_tilde, r_cache, sink_bias, scale, cache_chunk_size, g_scalar_cumsum=None):
    """What fla's `parallel_wall_attn_decode` computes (its docstring and `build_wall_kv_cache`'s: k_tilde_j =
    k_j 2^(R_c(j) - P_j), R_c the prefix at key j's chunk start), restated for the CPU, where its kernel does not
    run: the last queries over every cached key, prefix sums in base 2."""
    queries, keys = q.shape[1], v.shape[1]
    anchors = r_cache.repeat_interleave(cache_chunk_size, dim=1)[:, :keys]
    causal = torch.ones(queries, keys, dtype=torch.bool, device=q.device).tril(keys - queries)[None, :, :, None, None]
    exponent = (p_curr[:, :, None] - anchors[:, None]).masked_fill(~causal, 0.0)
    logits = (q[:, :, None] * k_tilde[:, None] * torch.exp2(exponent)).sum(-1) * scale  # (B, Tq, T, HQ)
    if g_scalar_cumsum is not None:
        logits = logits + (g_scalar_cumsum[:, -queries:, None] - g_scalar_cumsum[:, None]) * math.log(2)
    probs = logits.masked_fill(~causal[..., 0], -math.inf).softmax(2)
    values = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    return torch.einsum("bqth,bthd->bqhd", probs, values.to(probs.dtype)).to(v.dtype), None


@pytest.fixture
def routed(monkeypatch, fla_naive):
    """The calls that reached fla's kernels, each (name, cu_seqlens or None): the kernels on CUDA; on the CPU fla's
    naive op for the parallel kernel and `decode_stand_in` for the decode kernel (tapelm's shape checks and fla's
    `build_wall_kv_cache`, plain PyTorch, run as they are)."""
    import fla.ops.wall_attn as library

    import tapelm.kernels

    calls = []
    if not ON_GPU:
        takes = tapelm.kernels.fla_takes
        monkeypatch.setattr(tapelm.kernels, "fla_takes", lambda x: x.device.type == "cpu" or takes(x))
    parallel = library.parallel_wall_attn if ON_GPU else fla_naive
    decode = library.parallel_wall_attn_decode if ON_GPU else decode_stand_in

    def parallel_call(q, k, v, g, g_scalar=None, scale=None, cu_seqlens=None):
        calls.append(("parallel", cu_seqlens))
        return parallel(q, k, v, g, g_scalar=g_scalar, scale=scale, cu_seqlens=cu_seqlens).to(q.dtype)

    def decode_call(*args, **kwargs):
        calls.append(("decode", None))
        return decode(*args, **kwargs)

    monkeypatch.setattr(library, "parallel_wall_attn", parallel_call)
    monkeypatch.setattr(library, "parallel_wall_attn_decode", decode_call)
    return calls


def fla_model(on: bool, dtype, **overrides):
    """Heads of 64, fla's path alone or no fast path, weights half the tiny models' scale, gate biases 4 (log g
    about -0.02 a token: fla rescales keys by the decay over up to 64 of them, which must stay within float32)."""
    paths = ["wall-attention-fla"] if on else []
    model = tiny_model("wall", dtype=dtype, fast_paths=paths, std=WEIGHT_STD / 2, hidden_size=256, **overrides)
    with torch.no_grad():
        for layer in model.model.layers:
            for gate in (layer.positional.gate, layer.positional.scalar_gate):
                if gate is not None:
                    gate.bias.fill_(4.0)
    return model


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("batch", BATCHES)
def test_fla_computes_the_reference_function(routed, batch, scalar):
    """Logits and every parameter's gradient through fla's parallel kernel against the reference, for a plain, a
    left-padded and a packed batch (one row of segments where the mask cuts the batch), with and without the scalar
    gate; every attention call went to fla."""
    ids = tokens(2, 40)
    inputs = batch_inputs(batch, ids)

    def run(setting, dtype):
        return trained_pass(fla_model(setting == "on", dtype, wall_scalar_gate=scalar), ids, inputs, dtype)

    with fast_paths.recording() as ran:
        compare_paths(run, torch.bfloat16 if ON_GPU else torch.float64, exact=1e-4)
    assert ran == {"wall-attention-fla"} and {name for name, _ in routed} == {"parallel"}
    assert all((cut is None) == (batch == "plain") for _, cut in routed)


@pytest.mark.parametrize("scalar", [False, True])
def test_fla_decodes_what_the_reference_computes(routed, scalar):
    """A prompt through the parallel kernel, then tokens one at a time through the decode kernel over tapelm's cache,
    against the reference's full pass; a left-padded batch decodes on the reference (the decode kernel takes no
    mask)."""
    dtype = torch.float32 if ON_GPU else torch.float64
    ids = tokens(2, 70)
    with torch.no_grad():
        expected = fla_model(False, dtype, wall_scalar_gate=scalar)(ids).logits
        got = decode_in_chunks(fla_model(True, dtype, wall_scalar_gate=scalar), ids, [66, 1, 1, 1, 1])
    close(got, expected, 2e-3 if ON_GPU else 1e-4)
    assert [name for name, _ in routed] == ["parallel"] * 2 + ["decode"] * 8
    routed.clear()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    net = fla_model(True, dtype)
    with torch.no_grad():
        generated = net.generate(ids[:, :20], attention_mask=mask[:, :20], max_new_tokens=3, do_sample=False)
    assert "decode" not in {name for name, _ in routed}
    reference = fla_model(False, dtype).generate(
        ids[:, :20], attention_mask=mask[:, :20], max_new_tokens=3, do_sample=False
    )
    assert torch.equal(generated, reference)


def test_fla_leaves_decoding_to_the_reference_where_rescaled_keys_overflow(routed):
    """Gates of e^-20 a token: fla's keys rescaled over a chunk pass float32's range after 5 tokens, so decoding goes
    to the reference from there, which computes every decay as a difference, and gives its tokens (a one-token
    prompt: fla's parallel kernel clamps such gates)."""
    ids = tokens(1, 1)
    nets = [fla_model(on, torch.float32) for on in (True, False)]
    with torch.no_grad():
        for net in nets:
            for layer in net.model.layers:
                layer.positional.gate.bias.fill_(-20.0)
        generated, reference = (net.generate(ids, max_new_tokens=9, do_sample=False) for net in nets)
    decoded = [name for name, _ in routed].count("decode")
    assert 0 < decoded < 2 * 8 and torch.equal(generated, reference)
