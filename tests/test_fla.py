"""FoX, PaTH and stick-breaking attention through fla ("forgetting-attention-fla", "path-attention-fla",
"stickbreaking-attention-fla") compute tapelm's reference function.

The tests run tapelm's whole adapter on every device (layouts, log gates, Householder vectors, packed documents and
padding as variable-length segments, cached decoding, and `kernel(x)`, the one place that names fla's function and
decides where it runs), and record each call that reaches fla's function: its kernel on CUDA; on the CPU, where its
kernels do not run (not even under Triton's CPU interpreter), fla's naive op in its place, one segment at a time where
fla's kernels take `cu_seqlens`, in float64 as well (the naive op computes in float32 whatever it is given: the
float64 model is held to float32's tolerance). A call that fla does not take (a shape outside fla's tests, float64 on
CUDA) goes to the reference, and a test that claims a path fails when no call reached fla. Under `pytest --device
cuda` the fast path runs in bf16, held to the reference path's own accuracy in bf16 (tests/accuracy.py). PaTH goes to
fla only within the shapes fla's own tests run (heads of 64 or 128, at least 512 tokens, sequences of at least 15):
the tests use such shapes, and check that others stay on the reference."""

import importlib

import pytest
import torch

import conftest
import tapelm.kernels
from accuracy import compare_paths, outputs
from conftest import DEVICE, decode_in_chunks, tiny_model, tokens
from tapelm import fast_paths
from tapelm.kernels.attention import AttentionMask
from tapelm.kernels.fla_layout import segments

pytestmark = [pytest.mark.device, pytest.mark.own_process]

naive_path = pytest.importorskip("fla.ops.path_attn.naive", reason="fla is not installed (pip install tapelm[gpu])")
naive_forgetting = pytest.importorskip(
    "fla.ops.forgetting_attn.naive", reason="fla is not installed (pip install tapelm[gpu])"
)
naive_stickbreaking = pytest.importorskip(
    "fla.ops.stickbreaking_attn.naive", reason="fla is not installed (pip install tapelm[gpu])"
)

ON_GPU = DEVICE.type == "cuda"
DTYPE = torch.bfloat16 if ON_GPU else torch.float64
NAIVE_TOLERANCE = 1e-4
"""Largest error allowed on the CPU, as a fraction of the reference tensor's largest entry (fla's naive ops round
to float32, amplified through two layers)."""
PATHS = {
    "fox": "forgetting-attention-fla",
    "path": "path-attention-fla",
    "stickbreaking": "stickbreaking-attention-fla",
}
FLA_FUNCTIONS = {
    "fox": ("fla.ops.forgetting_attn", "parallel_forgetting_attn"),
    "path": ("fla.ops.path_attn", "parallel_path_attn"),
    "stickbreaking": ("fla.ops.stickbreaking_attn", "parallel_stickbreaking_attn"),
}
"""Where tapelm's adapters find fla's function (kernels/forgetting_attention/fla.py, kernels/path_attention/fla.py,
kernels/stickbreaking_attention/fla.py)."""
LENGTH = 256
"""Tokens per row: two rows make the 512 tokens fla's PaTH tests run at least."""


def per_segment(op):
    """fla's `cu_seqlens` semantics for a naive op that takes whole sequences: each segment of the one row alone.
    Called as fla's kernels are: (*tensors, scale=..., cu_seqlens=..., **options); the output in the inputs' dtype."""

    def run(*tensors, scale, cu_seqlens=None, **options):
        if cu_seqlens is None:
            return op(*tensors, scale, **options).to(tensors[0].dtype)
        bounds = cu_seqlens.tolist()
        pieces = [op(*(x[:, a:b] for x in tensors), scale, **options) for a, b in zip(bounds[:-1], bounds[1:])]
        return torch.cat(pieces, dim=1).to(tensors[0].dtype)

    return run


def naive_path_attn(q, k, v, w, beta, scale):
    no_gates = torch.zeros(*q.shape[:3], dtype=torch.float32, device=q.device)
    return naive_path.naive_path_attn(q, k, v, w, beta, no_gates, scale)


def path_with_keys(*tensors, scale, cu_seqlens=None):
    """As fla's PaTH kernel returns: the output and (unused here) the transformed keys."""
    return per_segment(naive_path_attn)(*tensors, scale=scale, cu_seqlens=cu_seqlens), None


def stickbreaking_with_rest(*tensors, scale, cu_seqlens=None, attend_current):
    """As fla's stick-breaking kernel returns: the output and (unused here) the stick each query left."""

    def output(q, k, v, scale, attend_current):
        return naive_stickbreaking.naive_stickbreaking_attn(q, k, v, scale, attend_current)[0]

    return per_segment(output)(*tensors, scale=scale, cu_seqlens=cu_seqlens, attend_current=attend_current), None


NAIVE = {
    "fox": per_segment(naive_forgetting.naive_forgetting_attn),
    "path": path_with_keys,
    "stickbreaking": stickbreaking_with_rest,
}


@pytest.fixture
def routed(monkeypatch):
    """The calls that reached fla's function, each (encoding, cu_seqlens): its kernels on CUDA; on the CPU its naive
    ops, which take any CPU tensor (so `tapelm.kernels.fla_takes` does there); tapelm's shape checks stay its own."""
    calls = []
    if not ON_GPU:
        takes = tapelm.kernels.fla_takes
        monkeypatch.setattr(tapelm.kernels, "fla_takes", lambda x: x.device.type == "cpu" or takes(x))
    for encoding, (module, name) in FLA_FUNCTIONS.items():
        library = importlib.import_module(module)

        def recorded(
            *tensors,
            scale,
            cu_seqlens=None,
            encoding=encoding,
            function=getattr(library, name) if ON_GPU else NAIVE[encoding],  # noqa: B008 (bound per encoding)
            **options,
        ):
            calls.append((encoding, cu_seqlens))
            return function(*tensors, scale=scale, cu_seqlens=cu_seqlens, **options)

        monkeypatch.setattr(library, name, recorded)
    return calls


def model(pe_type, on: bool, dtype=None, **overrides):
    """Heads of 64 (a size fla's PaTH tests run), fla's path alone or no fast path; weights half the tiny models'
    scale, the model being four times as wide."""
    return tiny_model(
        pe_type,
        dtype=dtype or DTYPE,
        fast_paths=[PATHS[pe_type]] if on else [],
        std=conftest.WEIGHT_STD / 2,
        **{"hidden_size": 256, **overrides},
    ).train()


def batch_inputs(kind, ids):
    """No mask; the first row left-padded by 5 tokens; two packed documents of 100 and N - 100 tokens a row."""
    if kind == "padded":
        mask = torch.ones_like(ids)
        mask[0, :5] = 0
        return {"attention_mask": mask}
    if kind == "packed":
        return {
            "position_ids": torch.cat(
                [torch.arange(100, device=DEVICE), torch.arange(ids.shape[1] - 100, device=DEVICE)]
            )[None]
        }
    return {}


@pytest.mark.parametrize("batch", ["plain", "padded", "packed"])
@pytest.mark.parametrize("pe_type", ["fox", "path", "stickbreaking"])
def test_fla_computes_the_reference_function(pe_type, batch, routed):
    """Logits and every parameter's gradient, fla against the reference, for a plain batch, a batch whose first row
    is left-padded, and packed documents; every attention call went to fla (one row of segments where the mask cuts
    the batch, and always for PaTH), except PaTH's padded batch, whose padding tokens are sequences of one token,
    shorter than fla's tests run."""
    ids = tokens(2, LENGTH)
    inputs = batch_inputs(batch, ids)

    def run(setting, dtype):
        net = model(pe_type, setting == "on", dtype)
        logits = net(ids, **inputs).logits
        weights = torch.randn(
            logits.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64, device="cpu"
        )
        (logits * weights.to(DEVICE, dtype)).sum().backward()
        return outputs(net, logits=logits)

    with fast_paths.recording() as ran:
        compare_paths(run, DTYPE, exact=NAIVE_TOLERANCE)
    if pe_type == "path" and batch == "padded":
        assert routed == [] and ran == set()
        return
    assert [name for name, _ in routed] == [pe_type] * 2 and ran == {PATHS[pe_type]}  # one call a layer
    if pe_type == "path" or batch != "plain":
        cuts = {"plain": [0, LENGTH, 2 * LENGTH], "packed": [0, 100, LENGTH, LENGTH + 100, 2 * LENGTH]}.get(batch)
        assert all(cut is not None and (cuts is None or cut.tolist() == cuts) for _, cut in routed)
    else:
        assert all(cut is None for _, cut in routed)


@pytest.mark.parametrize("pe_type", ["fox", "path", "stickbreaking"])
def test_fla_prefill_then_cached_decoding_equals_the_reference(pe_type, routed):
    """The prompt through fla fills tapelm's own cache (FoX's cumulative gates, PaTH's carried keys, stick-breaking's
    keys); a second chunk after it (its mask covers the cached keys too) and the decoding steps read the cache on the
    reference path: the logits of the prompt, of the chunk and of four tokens decoded one at a time equal the
    reference's."""
    ids = tokens(2, LENGTH + 20)

    def run(setting, dtype):
        with torch.no_grad():
            return {
                "logits": decode_in_chunks(model(pe_type, setting == "on", dtype).eval(), ids, [LENGTH, 16] + [1] * 4)
            }

    compare_paths(run, DTYPE, exact=NAIVE_TOLERANCE)
    assert [name for name, _ in routed] == [pe_type] * 2  # the prompt only


def test_path_stays_on_the_reference_outside_the_shapes_fla_tests(routed):
    """Heads of 16, fewer than 512 tokens, a sequence shorter than 15 tokens, or on CUDA float64 (which fla's kernels
    do not take, for FoX too): the reference; fla's path off by default ("auto") until a GPU run verified it."""
    with torch.no_grad():
        if ON_GPU:
            model("path", True, dtype=torch.float64)(tokens(2, LENGTH))
            model("fox", True, dtype=torch.float64)(tokens(2, LENGTH))
        model("path", True, hidden_size=64)(tokens(2, LENGTH))  # heads of 16
        model("path", True)(tokens(2, 200))  # 400 tokens
        short = torch.cat([torch.arange(10, device=DEVICE), torch.arange(LENGTH - 10, device=DEVICE)])[None]
        model("path", True)(tokens(2, LENGTH), position_ids=short)  # documents of 10 tokens
        tiny_model("path", dtype=DTYPE, hidden_size=256)(tokens(2, LENGTH))
        tiny_model("fox", dtype=DTYPE, hidden_size=256)(tokens(2, LENGTH))
    assert routed == []


def test_segments_read_the_mask():
    causal = torch.ones(6, 6, dtype=torch.bool, device=DEVICE).tril()
    documents = causal.clone()
    documents[3:, :3] = False
    padded = causal.clone()
    padded[:, :2] = False
    padded[:2, :2] = torch.eye(2, dtype=torch.bool, device=DEVICE)  # padding sees itself
    window = causal & ~torch.ones(6, 6, dtype=torch.bool, device=DEVICE).tril(-3)
    continued = torch.ones(6, 9, dtype=torch.bool, device=DEVICE).tril(3)  # 3 cached keys before 6 queries

    def cuts(valid, batch=1, keys=6):
        return segments(AttentionMask(valid, valid is None), batch, 6, keys)

    assert cuts(None) is None
    assert cuts(causal[None, None]) is None
    assert cuts(documents[None, None]).tolist() == [0, 3, 6]
    assert cuts(torch.stack([padded, causal])[:, None], batch=2).tolist() == [0, 1, 2, 6, 12]
    assert cuts(window[None, None]) is False
    assert cuts(torch.ones(1, 1, 6, 6, dtype=torch.bool, device=DEVICE)) is False  # not causal
    assert cuts(causal[None, None], keys=8) is False  # cached keys
    assert cuts(continued[None, None]) is False  # cached keys the call does not hold, but the mask covers
    assert segments(AttentionMask(None, False), 1, 6, 6) is False


FLA_MODULES = (
    "fla.modules.fused_linear_cross_entropy",
    "fla.modules.activations",
    "fla.modules.norm.layernorm",
    "fla.modules.rotary",
    "fla.ops.forgetting_attn",
    "fla.ops.path_attn",
    "fla.ops.stickbreaking_attn",
)
"""The fla modules tapelm's fla paths call (kernels/*/fla.py)."""
REACHED = (
    "fla.modules.",
    "fla.ops.forgetting_attn",
    "fla.ops.path_attn",
    "fla.ops.stickbreaking_attn",
    "fla.ops.attn",
    "fla.ops.utils",
)
"""Where the kernels those calls reach are defined (fla's modules, its attention ops and their shared utilities;
importing them loads others too, e.g. DeltaFormer's, whose keys hold lengths but which tapelm does not call)."""


def test_fla_autotunes_a_few_configurations_on_keys_that_hold_no_sequence_length():
    """Every fla kernel loaded with the modules tapelm calls benchmarks at most `AUTOTUNE_CONFIGS` configurations at a
    new tuning key, spread over fla's list; no tuning key names a sequence length (T), so decoding, whose calls
    differ only in it, tunes nothing new at a new length."""
    from fla.modules.activations.ops import _activation_autotune_configs, swiglu_fwd_kernel

    for module in FLA_MODULES:
        tapelm.kernels._fla_module(module)
    tuners = tapelm.kernels.bound_fla_autotuning()
    assert all(1 <= len(tuner.configs) <= tapelm.kernels.AUTOTUNE_CONFIGS for tuner in tuners)
    reached = [tuner for tuner in tuners if tuner.base_fn.__module__.startswith(REACHED)]
    assert len(reached) > 20 and not [(tuner.base_fn.__name__, tuner.keys) for tuner in reached if "T" in tuner.keys]
    if not ON_GPU:  # on CUDA the law tests keep the first configuration only (conftest.py)
        listed = [str(config) for config in _activation_autotune_configs()]  # 30: 5 block sizes x 6 num_warps
        assert [str(config) for config in swiglu_fwd_kernel.configs] == [listed[i] for i in (0, 10, 19, 29)]
