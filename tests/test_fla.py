"""FoX and PaTH through fla (tapelm.kernels.fla) compute tapelm's reference function.

On the CPU the adapter (layouts, log gates, Householder vectors, packed documents and padding as variable-length
segments, cached decoding) is routed to fla's naive ops, which run there (its kernels do not run under Triton's CPU
interpreter), one segment at a time where fla's kernels take `cu_seqlens`. fla's naive ops compute in float32, so the
float64 model is held to float32's tolerance. Under `pytest --device cuda` the same tests run fla's kernels in bf16,
held to the reference path's own accuracy in bf16 (tests/accuracy.py)."""

import pytest
import torch

from accuracy import compare_paths, outputs
from conftest import DEVICE, decode_in_chunks, tiny_model, tokens
from tapelm.attention import AttentionMask
from tapelm.kernels import fla

pytestmark = pytest.mark.device

naive_path = pytest.importorskip("fla.ops.path_attn.naive", reason="fla is not installed (pip install tapelm[gpu])")
naive_forgetting = pytest.importorskip("fla.ops.forgetting_attn.naive")

ON_GPU = DEVICE.type == "cuda"
DTYPE = torch.bfloat16 if ON_GPU else torch.float64
NAIVE_TOLERANCE = 1e-4
"""Largest error allowed on the CPU, as a fraction of the reference tensor's largest entry (fla's naive ops round
to float32, amplified through two layers)."""


def per_segment(op):
    """fla's `cu_seqlens` semantics for a naive op that takes whole sequences: each segment of the one row alone.
    Called as fla's ops are: (*tensors, scale, cu_seqlens)."""
    def run(*args):
        *tensors, scale, cu_seqlens = args
        if cu_seqlens is None:
            return op(*tensors, scale)
        bounds = cu_seqlens.tolist()
        return torch.cat([op(*(x[:, a:b] for x in tensors), scale) for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
    return run


def naive_path_attn(q, k, v, w, beta, scale):
    no_gates = torch.zeros(*q.shape[:3], dtype=torch.float32, device=q.device)
    return naive_path.naive_path_attn(q, k, v, w, beta, no_gates, scale)


NAIVE = fla.FlaOps(per_segment(naive_forgetting.naive_forgetting_attn), per_segment(naive_path_attn))


def recorded(ops, calls):
    """`ops`, noting each call's encoding and `cu_seqlens`."""
    def forgetting(*args):
        calls.append(("fox", args[-1]))
        return ops.forgetting(*args)

    def path(*args):
        calls.append(("path", args[-1]))
        return ops.path(*args)

    return fla.FlaOps(forgetting, path)


@pytest.fixture
def routed(monkeypatch):
    """The calls that reached fla: its kernels on CUDA, its naive ops elsewhere."""
    calls = []
    ops = recorded(fla.operations(torch.empty(0, device=DEVICE, dtype=DTYPE)) if ON_GPU else NAIVE, calls)
    monkeypatch.setattr(fla, "operations", lambda tensor: ops)
    return calls


def model(pe_type, setting, dtype=None, **overrides):
    """Heads of 16 (a size fla's PaTH kernel takes)."""
    return tiny_model(pe_type, dtype=dtype or DTYPE, fast_paths=setting, **{"hidden_size": 64, **overrides}).train()


def batch_inputs(kind, ids):
    """No mask; the first row left-padded by 5 tokens; two packed documents of 7 and N - 7 tokens."""
    if kind == "padded":
        mask = torch.ones_like(ids)
        mask[0, :5] = 0
        return {"attention_mask": mask}
    if kind == "packed":
        return {"position_ids": torch.cat([torch.arange(7, device=DEVICE),
                                           torch.arange(ids.shape[1] - 7, device=DEVICE)])[None]}
    return {}


@pytest.mark.parametrize("batch", ["plain", "padded", "packed"])
@pytest.mark.parametrize("pe_type", ["fox", "path"])
def test_fla_computes_the_reference_function(pe_type, batch, routed):
    """Logits and every parameter's gradient, fla against the reference, for a plain batch, a batch whose first row
    is left-padded, and packed documents; every attention call went to fla, as one row of segments where the mask
    cuts the batch."""
    ids = tokens(2, 20)
    inputs = batch_inputs(batch, ids)

    def run(setting, dtype):
        net = model(pe_type, setting, dtype)
        logits = net(ids, **inputs).logits
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64,
                              device="cpu")
        (logits * weights.to(DEVICE, dtype)).sum().backward()
        return outputs(net, logits=logits)

    compare_paths(run, DTYPE, exact=NAIVE_TOLERANCE)
    assert [name for name, _ in routed] == [pe_type] * 2  # one call per layer, none while the reference ran
    if batch != "plain":
        assert all(cuts is not None for _, cuts in routed)
    elif pe_type == "fox":
        assert all(cuts is None for _, cuts in routed)
    else:  # PaTH runs each row as a segment of its own (fla 0.6's kernel without segments failed on a GPU)
        assert all(cuts.tolist() == [0, 20, 40] for _, cuts in routed)


@pytest.mark.parametrize("pe_type", ["fox", "path"])
def test_fla_prefill_then_cached_decoding_equals_the_reference(pe_type, routed):
    """The prompt through fla fills tapelm's own cache (FoX's cumulative gates, PaTH's carried keys); the decoding
    steps read it on the reference path: the logits of the prompt and of six tokens decoded one at a time (the same
    tokens on both paths) equal the reference's."""
    ids = tokens(2, 18)

    def run(setting, dtype):
        with torch.no_grad():
            return {"logits": decode_in_chunks(model(pe_type, setting, dtype).eval(), ids, [12] + [1] * 6)}

    compare_paths(run, DTYPE, exact=NAIVE_TOLERANCE)
    assert [name for name, _ in routed] == [pe_type] * 2  # the prefill only


def test_fla_is_off_by_default_and_falls_back_where_it_cannot_take_the_call(routed):
    """"auto" keeps fla off until a GPU run verified it; head sizes the PaTH kernel lacks run the reference."""
    ids = tokens(1, 10)
    model("path", "auto")(ids)
    model("fox", "auto")(ids)
    model("path", "on", hidden_size=32)(ids)  # heads of 8
    assert routed == []


def test_segments_read_the_mask():
    causal = torch.ones(6, 6, dtype=torch.bool, device=DEVICE).tril()
    documents = causal.clone()
    documents[3:, :3] = False
    padded = causal.clone()
    padded[:, :2] = False
    padded[:2, :2] = torch.eye(2, dtype=torch.bool, device=DEVICE)  # padding sees itself
    window = causal & ~torch.ones(6, 6, dtype=torch.bool, device=DEVICE).tril(-3)

    def cuts(valid, batch=1, keys=6):
        return fla.segments(AttentionMask(valid, valid is None), batch, 6, keys)

    assert cuts(None) is None
    assert cuts(causal[None, None]) is None
    assert cuts(documents[None, None]).tolist() == [0, 3, 6]
    assert cuts(torch.stack([padded, causal])[:, None], batch=2).tolist() == [0, 1, 2, 6, 12]
    assert cuts(window[None, None]) is False
    assert cuts(torch.ones(1, 1, 6, 6, dtype=torch.bool, device=DEVICE)) is False  # not causal
    assert cuts(causal[None, None], keys=8) is False  # cached keys
    assert fla.segments(AttentionMask(None, False), 1, 6, 6) is False
