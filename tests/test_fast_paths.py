"""Every fast path computes its reference's function: the attention calls alone and whole models, forward and every
gradient, in float64 on the CPU (on a device, where the kernels take half precision, as accurately as the reference
path in that precision: tests/accuracy.py); a checkpoint trained on either path gives the same logits on the other."""

import pytest
import torch

from accuracy import compare_paths, outputs
from conftest import DEVICE, tiny_model, tokens
from tapelm import fast_paths
from tapelm.kernels.attention import AttentionMask, attend_stream, blocks, cpu_flash, padded_attention
from tapelm.kernels.attention.unpadded import unpadded_attention
from tapelm.kernels.rotation import rotate_halves
from tapelm.kernels.rotation.autograd import HalvesRotation

pytestmark = pytest.mark.device

DTYPE = torch.float64 if DEVICE.type == "cpu" else torch.bfloat16


def close(actual, expected, what=""):
    tolerance = {torch.float64: 1e-12, torch.bfloat16: 3e-2}[DTYPE]
    torch.testing.assert_close(actual.to(expected.dtype), expected, atol=tolerance, rtol=tolerance, msg=what)


def random(*shape, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=generator, device="cpu").to(DEVICE)


def masks(batch, length):
    causal = torch.ones(length, length, dtype=torch.bool, device=DEVICE).tril()
    padded = causal.expand(batch, 1, -1, -1).clone()
    padded[0, :, :, :3] = False
    padded[0, 0, :3, :3] = torch.eye(3, dtype=torch.bool, device=DEVICE)  # padding tokens see themselves
    empty = padded.clone()
    empty[1, :, 4, :] = False  # a query that sees no key (the flash kernel gives it output 0)
    return {
        "causal flag": AttentionMask(None, True),
        "no mask": AttentionMask(None, False),
        "padding": AttentionMask(padded, False),
        "a query sees nothing": AttentionMask(empty, False),
    }


def stream_outputs(path, q, k, stream, mask, value_width):
    """(V's output, the rest's output) by one way of attending."""
    if path == "stream":
        with fast_paths.recording() as ran:
            outputs = attend_stream(q, k, stream, value_width, mask, None, 0.3, frozenset({"attention-cpu-flash"}))
        assert ran == {"attention-cpu-flash"}
        return outputs
    out = {"reference": padded_attention, "unpadded": unpadded_attention}[path](
        q, k, stream, mask.valid, mask.is_causal, 0.3
    )
    return out[..., :value_width], out[..., value_width:]


@pytest.mark.parametrize("mask_kind", ["causal flag", "no mask", "padding"])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("path", ["stream", "unpadded"])
def test_attention_fast_paths_equal_the_padded_reference(path, kv_heads, mask_kind):
    """The CPU flash function for a wider stream (on the CPU) and the unpadded call (every device: on the CPU SDPA's
    math kernel, on CUDA the kernels that take a wider value): outputs and the gradients of q, k and the stream."""
    if path == "stream" and DEVICE.type != "cpu":
        pytest.skip("CpuFlashAttention runs on the CPU only")
    compare_stream_attention(path, kv_heads, mask_kind, DTYPE)


@pytest.mark.parametrize("queries", [1, 3])
def test_unpadded_attention_takes_cudnn_in_training_passes_over_own_keys_only(queries, monkeypatch):
    """cuDNN builds a graph for each new shape: queries over more keys (a decoding step, a prompt continued) and
    passes without gradients (decoding without a cache, one token longer each step) leave it out; a training pass
    over its own keys may run it. The output is the padded reference's."""
    from tapelm.kernels.attention import unpadded

    requested = []
    monkeypatch.setattr(
        unpadded,
        "sdpa_kernel",
        lambda backends, sdpa_kernel=unpadded.sdpa_kernel: requested.append(list(backends)) or sdpa_kernel(backends),
    )
    q, k, stream = (
        random(2, heads, length, width, seed=seed).to(DTYPE)
        for heads, length, width, seed in ((4, queries, 8, 1), (2, 7, 8, 2), (2, 7, 24, 3))
    )
    valid = torch.ones(queries, 7, dtype=torch.bool, device=DEVICE).tril(7 - queries)
    close(unpadded_attention(q, k, stream, valid, False, 0.3), padded_attention(q, k, stream, valid, False, 0.3))
    own = k.repeat(1, 2, 1, 1)
    with torch.no_grad():
        unpadded_attention(own.requires_grad_(), k, stream, None, True, 0.3)
    unpadded_attention(own, k, stream, None, True, 0.3)
    assert [unpadded.SDPBackend.CUDNN_ATTENTION in backends for backends in requested] == [False, False, True]


@pytest.fixture
def blockwise_calls(monkeypatch):
    """On the CPU, `stream_attention_backward` over blocks of 8 queries, its calls counted (a list, one entry a
    call)."""
    if DEVICE.type != "cpu":
        pytest.skip("CpuFlashAttention runs on the CPU only")
    monkeypatch.setattr(cpu_flash, "STREAM_BACKWARD_BLOCK", 8)
    calls = []
    monkeypatch.setattr(
        cpu_flash,
        "stream_attention_backward",
        lambda *args, backward=cpu_flash.stream_attention_backward: calls.append(1) or backward(*args),
    )
    return calls


@pytest.mark.parametrize("mask_kind", ["causal flag", "no mask", "padding", "a query sees nothing"])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_cpu_backward_over_blocks_of_queries_computes_the_reference_gradients(
    mask_kind, kv_heads, dtype, blockwise_calls
):
    """`stream_attention_backward` (float32 and float64) over blocks of 8 queries, the last one short, with SDPA's
    causal flag, every key, or a mask tensor (padding; a query that sees no key): in float32 as accurately as the
    reference path in float32."""
    compare_stream_attention("stream", kv_heads, mask_kind, dtype, length=37, d=16)
    assert blockwise_calls


def compare_stream_attention(path, kv_heads, mask_kind, dtype, length=11, d=8):
    """A path's outputs and the gradients of q, k and a stream 3 d wide against the padded reference
    (`compare_paths`)."""
    batch, width = 2, 3 * d
    mask = masks(batch, length)[mask_kind]
    inputs = [
        random(batch, 4, length, d, seed=1),
        random(batch, kv_heads, length, d, seed=2),
        random(batch, kv_heads, length, width, seed=3),
    ]
    weights = (random(batch, 4, length, d, seed=4), random(batch, 4, length, width - d, seed=5))

    def run(setting, dtype):
        leaves = [x.to(dtype, copy=True).requires_grad_() for x in inputs]
        values, extra = stream_outputs(path if setting == "on" else "reference", *leaves, mask, d)
        ((values * weights[0].to(dtype)).sum() + (extra * weights[1].to(dtype)).sum()).backward()
        return {
            "values": values.detach(),
            "extra": extra.detach(),
            **{f"{name} grad": leaf.grad for name, leaf in zip(("q", "k", "stream"), leaves)},
        }

    compare_paths(run, dtype)


def saved_bytes(model, ids) -> int:
    """Bytes of the distinct storages autograd keeps for the backward pass of the model's loss on `ids`."""
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor.detach()  # the tensor itself would keep the graph alive (tapelm.bench.speed._saved_bytes)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(ids, labels=ids).loss.detach()
    return sum(storages.values())


def test_the_cpu_stream_kernel_keeps_less_for_the_backward_pass():
    """What it is for: no zero-padded q and k, and no copy of V's output, kept between the passes."""
    if DEVICE.type != "cpu":
        pytest.skip("CpuFlashAttention runs on the CPU only")
    saved = {}
    for setting in ("off", "on"):
        model = tiny_model("tape", num_hidden_layers=3).train()
        model.config.fast_paths = setting
        saved[setting] = saved_bytes(model, tokens(4, 64))
    assert saved["on"] < saved["off"], saved


TAPE_VARIANTS = {
    "heads": {},
    "per-head": {"tape_attn_mixing": "per_head"},
    "grouped": {"num_key_value_heads": 4},
    "blocks 2x4": {"tape_block": (2, 4)},
    "attention update only": {"tape_update": "attention"},
    "schedule with RoPE and ALiBi layers": {
        "num_hidden_layers": 4,
        "layer_pe_types": ["tape", "rope", "tape", "alibi"],
    },
}
BATCHES = ("plain", "padded", "packed")


def batch_inputs(kind, ids):
    if kind == "padded":
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        return {"attention_mask": mask}
    if kind == "packed":
        half = ids.shape[1] // 2
        return {
            "position_ids": torch.cat(
                [torch.arange(half, device=DEVICE), torch.arange(ids.shape[1] - half, device=DEVICE)]
            )[None]
        }
    return {}


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("variant", list(TAPE_VARIANTS))
def test_a_model_on_its_fast_paths_computes_the_reference_function(variant, batch):
    """TAPE with every fast path the device offers (`fast_paths="on"`) against the reference paths ("off"): logits
    and every parameter's gradient."""
    ids = tokens(2, 16)
    compare_paths(
        lambda setting, dtype: trained_pass(
            tiny_model("tape", dtype=dtype, fast_paths=setting, **TAPE_VARIANTS[variant]), ids, batch
        ),
        DTYPE,
    )


def trained_pass(model, ids, batch, seed=7):
    """Logits, the loss (fused with the output projection where "fused-modules" runs) and every gradient of one
    training pass whose backward weighs the logits at random and adds the loss."""
    model.train()
    inputs = batch_inputs(batch, ids)
    logits = model(ids, **inputs).logits
    loss = model(ids, labels=ids, **inputs).loss
    ((logits * random(*logits.shape, seed=seed).to(logits.dtype)).sum() + loss).backward()
    return outputs(model, logits=logits, loss=loss)


ROTATIONS = {  # x's shape and (a, b)'s: TAPE's grouped queries and keys, RoPE's tables over heads, one token
    "grouped queries": ((2, 3, 2, 5, 8), (2, 3, 1, 5, 4)),
    "keys": ((2, 3, 5, 8), (2, 3, 5, 4)),
    "tables": ((2, 4, 5, 8), (2, 1, 5, 4)),
    "one token": ((1, 2, 1, 1, 8), (1, 2, 1, 1, 4)),
}


@pytest.mark.parametrize("angles_need_grad", [True, False])
@pytest.mark.parametrize("layout", list(ROTATIONS))
def test_the_rotation_function_computes_the_reference_function(layout, angles_need_grad):
    """HalvesRotation against rotate_halves: the very output, in x's memory layout, and the gradient of x and of
    (a, b), broadcast as the encodings broadcast them, x a strided view as the projections give it."""
    x_shape, angle_shape = ROTATIONS[layout]
    x = random(*x_shape[:-3], x_shape[-2], x_shape[-3], x_shape[-1], seed=1).transpose(-2, -3).to(DTYPE)
    a, b = (random(*angle_shape, seed=seed).to(DTYPE) for seed in (2, 3))
    weights = random(*x_shape, seed=4).to(DTYPE)
    results = []
    for rotation in (rotate_halves, HalvesRotation.apply):
        inputs = [x.detach().requires_grad_(), *(t.detach().requires_grad_(angles_need_grad) for t in (a, b))]
        out = rotation(*inputs)
        (out * weights).sum().backward()
        results.append((out, [t.grad for t in inputs]))
    assert torch.equal(results[1][0], results[0][0])  # each product rounded as the reference rounds it
    assert results[0][0].stride() == results[1][0].stride() == x.stride()  # attention's output then keeps it too
    for name, actual, expected in zip("xab", results[1][1], results[0][1]):
        assert (actual is None) == (expected is None), name
        if expected is not None:
            close(actual, expected, name)


@pytest.mark.parametrize("angles_need_grad", [True, False])
def test_the_rotation_function_keeps_no_more_than_the_reference(angles_need_grad):
    """Between the passes: x and the angles for TAPE's state, only the angles for RoPE's tables (which need no
    gradient), as autograd through the reference keeps."""
    x = torch.randn(2, 3, 5, 8, device=DEVICE, requires_grad=True)
    a, b = torch.randn(2, 1, 5, 8, device=DEVICE, requires_grad=angles_need_grad).chunk(2, dim=-1)
    kept = []
    for rotation in (rotate_halves, HalvesRotation.apply):
        storages = {}

        def pack(tensor, storages=storages):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            rotation(x, a, b)
        kept.append(storages)
    assert kept[1] == kept[0]


def test_the_rotation_function_keeps_the_input_dtypes():
    """bf16 q and k (autocast) rotated by float32 angles: a float32 output, as the reference gives, and each gradient
    in its input's dtype."""
    x = torch.randn(2, 3, 5, 8, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    a, b = (torch.randn(2, 1, 5, 4, device=DEVICE, requires_grad=True) for _ in range(2))
    out = HalvesRotation.apply(x, a, b)
    reference = rotate_halves(x, a, b)
    assert out.dtype == reference.dtype == torch.float32
    torch.testing.assert_close(out, reference)
    out.sum().backward()
    assert (x.grad.dtype, a.grad.dtype, b.grad.dtype) == (torch.bfloat16, torch.float32, torch.float32)


@pytest.mark.parametrize("encoding", ["rope", "xpos"])
def test_rotary_encodings_on_their_fast_paths_compute_the_reference_function(encoding):
    """RoPE and xPos with every fast path the device offers against the reference paths, on a padded batch."""
    ids = tokens(2, 16)
    compare_paths(
        lambda setting, dtype: trained_pass(tiny_model(encoding, dtype=dtype, fast_paths=setting), ids, "padded"), DTYPE
    )


@pytest.mark.compiles
@pytest.mark.parametrize("batch", ["plain", "padded"])
def test_compiled_layers_take_the_blockwise_backward_and_give_the_eager_gradients(batch, monkeypatch):
    """`compile_layers()` (dynamic shapes, AOTAutograd tracing the backward pass) on a batch without padding and on
    a padded one (a mask tensor): the blockwise attention backward (blocks of 8) is traced without a graph break,
    and every gradient equals the eager model's in float64."""
    from torch._dynamo.utils import counters

    if DEVICE.type != "cpu":
        pytest.skip("CpuFlashAttention runs on the CPU only")
    monkeypatch.setattr(cpu_flash, "STREAM_BACKWARD_BLOCK", 8)

    ids = tokens(2, 21)
    grads = {}
    for compiled in (False, True):
        model = tiny_model("tape", dtype=torch.float64).train()
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            model.compile_layers(backend="aot_eager")
        model(ids, labels=ids, **batch_inputs(batch, ids)).loss.backward()
        grads[compiled] = {name: param.grad for name, param in model.named_parameters()}
    assert not counters["graph_break"], dict(counters["graph_break"])
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, atol=1e-12, rtol=0, msg=name)


def cancelling_paths(float64_on: bool):
    """Two paths of a sum that is zero by law (8,192 terms that cancel in pairs: two summation orders) and of a
    well-conditioned sum, as `compare_paths` runs them; with `float64_on` False the "on" path takes no float64 (as
    CUDA's memory-efficient kernel), where the reference runs in its place. `wrong` and `shift` make it wrong."""
    generator = torch.Generator().manual_seed(2)
    terms = torch.randn(4096, dtype=torch.float64, generator=generator, device="cpu")
    cancelling = torch.cat([terms, -terms])
    orders = {
        setting: torch.randperm(cancelling.numel(), generator=generator, device="cpu") for setting in ("off", "on")
    }

    def run(setting, dtype, wrong=0.0, shift=0.0):
        taken = setting == "on" and (float64_on or dtype != torch.float64)
        x = cancelling[orders["on" if taken else "off"]].to(dtype)
        zero = x.view(-1, 8).sum(1).view(-1, 8).sum(1).sum(0, keepdim=True)
        sizeable = (3 * terms).to(dtype).sum(0, keepdim=True)
        if setting == "on" and dtype != torch.float64:
            zero, sizeable = zero + wrong, sizeable * (1 + shift)
        return {"zero": zero, "sizeable": sizeable}

    return run


@pytest.mark.parametrize("float64_on", [True, False], ids=["float64 on the path", "float64 on the reference"])
def test_the_accuracy_rule_takes_a_tensor_made_by_cancellation_at_its_terms_size(float64_on):
    """Two summation orders as the two paths, in bf16. Where the path runs in float64, float64's two orders disagree;
    where it does not (FIRE's last bias on CUDA's memory-efficient kernel, docs/gpu/h100-2026-11-28/: off by 0.0245
    where the rule allowed 0.0157; in float64 SDPA's math kernel stands in, the same computation as the reference),
    they agree bit for bit and the reference in float32 disagrees with them in more than half of its digits. Either
    shows the cancellation, so the rounding step is taken of the terms' size and the paths' bf16 noise passes (the
    tensor's norm, 2e-14, would fail it: its errors are 0.33 against the reference path's 0.012); a path that is off
    by 2 fails, as does a well-conditioned tensor off by one of its own roundings many times over."""
    import accuracy

    run = cancelling_paths(float64_on)
    truth, other = run("off", torch.float64)["zero"], run("on", torch.float64)["zero"]
    assert torch.equal(other, truth) != float64_on
    noise = (run("on", torch.bfloat16)["zero"].double() - truth).norm()
    assert (
        noise
        > accuracy.FACTOR * (run("off", torch.bfloat16)["zero"].double() - truth).norm()
        + accuracy.ROUNDING[torch.bfloat16] * truth.norm()
    )
    probe = (other, torch.float64) if float64_on else (run("off", torch.float32)["zero"].double(), torch.float32)
    assert accuracy.rounding_scale(truth, *probe) > 1e3 * truth.norm()
    compare_paths(run, torch.bfloat16)
    with pytest.raises(AssertionError, match="zero: error"):
        compare_paths(lambda setting, dtype: run(setting, dtype, wrong=2.0), torch.bfloat16)
    with pytest.raises(AssertionError, match="sizeable: error"):
        compare_paths(lambda setting, dtype: run(setting, dtype, shift=0.05), torch.bfloat16)


def test_the_accuracy_rule_counts_the_roundings_of_a_sum_over_blocks():
    """A gradient summed over 4 blocks of queries in bf16, as the blocks path sums a bf16 parameter's (FIRE's
    `fire.c` on the H100, packed: 0.00134 where one rounding step allowed 0.00128): 3 roundings more than the
    reference's one sum, each at about the sum's size. One step fails the same sum; four (`accumulated=4`) pass it, and
    a path that drops a block still fails."""
    import accuracy

    terms = torch.rand(4, 100, dtype=torch.float64, generator=torch.Generator().manual_seed(2), device="cpu") / 100

    def run(setting, dtype, blocks=4):
        if setting == "off":
            return {"grad": terms.to(dtype).sum().reshape(1)}
        parts = terms.to(dtype).sum(1)
        total = parts[0]
        for part in parts[1 : blocks if dtype != torch.float64 else 4]:
            total = total + part  # rounded to the dtype at each block
        return {"grad": total.reshape(1)}

    truth = terms.sum()
    own_error = (run("off", torch.bfloat16)["grad"].double() - truth).abs()
    one_step = accuracy.FACTOR * own_error + accuracy.ROUNDING[torch.bfloat16] * truth
    assert (run("on", torch.bfloat16)["grad"].double() - truth).abs() > one_step
    compare_paths(run, torch.bfloat16, accumulated=4)
    with pytest.raises(AssertionError, match="grad: error"):
        compare_paths(lambda setting, dtype: run(setting, dtype, blocks=3), torch.bfloat16, accumulated=4)


def test_a_checkpoint_gives_the_same_logits_on_either_path(tmp_path):
    """The fast paths add no parameter and change no name: a model saved with them loads with them off."""
    model = tiny_model("tape", dtype=torch.float64, fast_paths="on")
    model.save_pretrained(tmp_path)
    from tapelm import TapeForCausalLM

    loaded = TapeForCausalLM.from_pretrained(tmp_path, fast_paths="off", dtype=torch.float64).to(DEVICE).eval()
    assert loaded.config.fast_paths == "off"
    assert {n: p.shape for n, p in loaded.state_dict().items()} == {n: p.shape for n, p in model.state_dict().items()}
    ids = tokens(2, 12)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-12, rtol=0)


def test_a_setting_resolves_to_the_paths_on_for_a_device_and_an_encoding():
    """ "off" none, "on" all, "auto" those verified for the device type and encoding (one object per setting, so that
    compiled layers' guards on it hold), a list exactly its names; anything else a one-line error."""
    resolve, cpu, cuda = fast_paths.resolve, torch.device("cpu"), torch.device("cuda")
    assert resolve("off", cuda, "tape") == frozenset()
    assert resolve("on", cpu, "tape") == frozenset(fast_paths.NAMES)
    for device in (cpu, cuda):
        for encoding in ("tape", "fire", "t5"):
            assert resolve("auto", device, encoding) == {
                path.name for path in fast_paths.PATHS if path.verified_for(device.type, encoding)
            }
    assert "attention-blocks" in resolve("auto", cuda, "t5") and "attention-blocks" not in resolve("auto", cuda, "fire")
    assert resolve(["rotation-triton", "attention-unpadded"], cuda, "rope") == {"rotation-triton", "attention-unpadded"}
    assert resolve("auto", cpu, "tape") is resolve("auto", cpu, "tape")
    assert tiny_model("tape", fast_paths=("rotation-autograd",)).config.fast_paths == ["rotation-autograd"]
    with pytest.raises(ValueError, match="fast_paths='fast' is not allowed; choose one of: auto, on, off, or a list"):
        tiny_model("tape", fast_paths="fast")
    with pytest.raises(ValueError, match="fast_paths names unknown fast path.s. rotation-cuda; choose one of: auto,"):
        tiny_model("tape", fast_paths=["rotation-autograd", "rotation-cuda"])


def test_a_forward_pass_resolves_its_setting_once(monkeypatch):
    """The causal-LM model resolves the config's setting and hands the result down; the decoder does not resolve it
    again."""
    import tapelm.modeling as modeling

    calls = []
    monkeypatch.setattr(
        modeling, "resolve", lambda *args, resolve=modeling.resolve: calls.append(args) or resolve(*args)
    )
    model = tiny_model("tape", fast_paths=["rotation-autograd"]).train()
    ids = tokens(2, 9)
    model(ids, labels=ids).loss.backward()
    assert calls == [(["rotation-autograd"], ids.device, ("tape",))]  # cuda:0 where DEVICE is "cuda"


def test_every_fast_path_is_one_candidate_of_one_dispatcher_beside_its_reference():
    """The one shape of a fast path: tapelm.kernels.<op>/ holds the reference (naive.py), a file per implementation
    and the dispatcher (__init__.py) whose ordered CANDIDATES name registered paths; every registered path is a
    candidate exactly once, and no dispatcher has a default for the paths it is handed."""
    import importlib
    import inspect
    from pathlib import Path

    import tapelm.kernels

    root = Path(tapelm.kernels.__file__).parent
    operations = {path.operation for path in fast_paths.PATHS}
    seen = []
    for operation in sorted(operations):
        folder = root / operation.replace("-", "_")
        assert (folder / "naive.py").exists(), operation
        dispatcher = importlib.import_module(f"tapelm.kernels.{folder.name}")
        for candidate in dispatcher.CANDIDATES:
            implementation = fast_paths.BY_NAME[candidate.path].implementation
            assert fast_paths.BY_NAME[candidate.path].operation == operation
            assert (folder / f"{implementation.replace('-', '_')}.py").exists(), candidate.path
            seen.append(candidate.path)
        for name, function in inspect.getmembers(dispatcher, inspect.isfunction):
            parameter = inspect.signature(function).parameters.get("paths")
            assert parameter is None or parameter.default is inspect.Parameter.empty, (folder.name, name)
        assert [candidate.path for candidate in dispatcher.CANDIDATES] == [
            path.name for path in fast_paths.PATHS if path.operation == operation
        ]  # in the registry's order
    assert sorted(seen) == sorted(fast_paths.NAMES)


def test_the_gpu_page_lists_every_fast_path_where_it_runs_by_default():
    """docs/GPU.md's table: every path in the registry's order, "on by default" as `verified` says."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "GPU.md").read_text()
    table = page.split("<!-- fast-paths:begin")[1].split("<!-- fast-paths:end -->")[0]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| `")]
    listed = [(cells[0].strip("| `"), cells[-1].strip(" |")) for cells in rows]

    def default(path):
        devices = [
            device if encodings is None else f"{device} ({', '.join(encodings)})"
            for device, encodings in path.verified.items()
        ]
        return "; ".join(devices) or "no"

    assert listed == [(path.name, default(path)) for path in fast_paths.PATHS]


def test_tapelms_triton_kernels_take_floating_tensors_on_cuda_or_under_the_interpreter(monkeypatch):
    """Where Triton runs them: CUDA, or the CPU under Triton's interpreter (how CI tests them); never while
    compiling. fla's kernels compute in float32: a float64 model keeps its precision on the reference path."""
    from tapelm import kernels

    pytest.importorskip("triton", reason="Triton is not installed (pip install tapelm[gpu])")
    x = torch.ones(1, dtype=torch.float64, device="cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not kernels.triton_takes(x)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.triton_takes(x) and not kernels.triton_takes(x.long())
    assert not kernels.fla_takes(x) and not kernels.fla_takes(x.float())  # fla runs on CUDA only


BIASED = {
    "t5": {},
    "t5 shared": {"pe_type": "t5", "t5_shared": True},
    "fire": {},
    "fire shared": {"pe_type": "fire", "fire_shared": True},
    "cope": {},
    "fox": {},
    "path": {},
    "grape-ap": {},
    "grape-a-qk": {},
}


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("encoding", list(BIASED))
def test_attention_over_blocks_of_queries_computes_the_reference_function(encoding, batch, monkeypatch):
    """Encodings whose bias needs a gradient, with attention a block of 5 queries at a time and each block's bias
    rebuilt in the backward pass, against the whole bias at once: logits and every parameter's gradient, each summed
    over the 4 blocks in the parameters' dtype (`accumulated`). PaTH walks chunks of 4 tokens, so blocks start inside
    chunks and meet earlier ones."""
    from tapelm.kernels.path_attention import naive as path_reference

    monkeypatch.setattr(blocks, "BIAS_BLOCK", 5)
    monkeypatch.setattr(path_reference, "CHUNK", 4)
    options = {"pe_type": encoding, **BIASED[encoding]}
    ids = tokens(2, 16)

    def run(setting, dtype):
        with fast_paths.recording() as ran:
            outputs = trained_pass(
                tiny_model(dtype=dtype, fast_paths=["attention-blocks"] if setting == "on" else [], **options),
                ids,
                batch,
                seed=8,
            )
        assert ran == ({"attention-blocks"} if setting == "on" else set())
        return outputs

    compare_paths(run, DTYPE, accumulated=-(-ids.shape[1] // blocks.BIAS_BLOCK))


@pytest.mark.parametrize("mask_kind", ["padding", "a query sees nothing"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_efficient_kernel_call_with_a_learned_bias_computes_the_reference_function(kv_heads, mask_kind):
    """The bias as a float mask on the memory-efficient kernel (SDPA's math kernel on the CPU), grouped KV heads
    expanded: the output and the gradients of q, k, v and of the bias (one row of it for the whole batch, as T5's and
    FIRE's are) against the padded reference."""
    from tapelm.kernels.attention.efficient import efficient_bias_attention
    from tapelm.kernels.attention.inputs import with_bias

    batch, length, d = 2, 11, 8
    mask = masks(batch, length)[mask_kind]
    inputs = [
        random(batch, 4, length, d, seed=1),
        random(batch, kv_heads, length, d, seed=2),
        random(batch, kv_heads, length, d, seed=3),
        random(1, 4, length, length, seed=4),
    ]
    weights = random(batch, 4, length, d, seed=5)

    def run(setting, dtype):
        q, k, v, bias = leaves = [x.to(dtype, copy=True).requires_grad_() for x in inputs]
        float_mask = with_bias(mask, bias)
        if setting == "on":
            out = efficient_bias_attention(q, k, v, float_mask, 0.3)
        else:
            out = padded_attention(q, k, v, float_mask, False, 0.3)
        out = torch.nan_to_num(out)  # the query that sees nothing: NaN on both paths' math kernel
        (out * weights.to(dtype)).sum().backward()
        return {
            "out": out.detach(),
            **{f"{name} grad": torch.nan_to_num(leaf.grad) for name, leaf in zip(("q", "k", "v", "bias"), leaves)},
        }

    compare_paths(run, DTYPE)


@pytest.mark.parametrize("encoding", list(BIASED))
def test_a_model_with_its_bias_on_the_efficient_kernel_computes_the_reference_function(encoding):
    """Every encoding whose bias needs a gradient, on a padded batch, with "attention-efficient" alone."""
    if DEVICE.type != "cuda":
        pytest.skip("the memory-efficient kernel runs on CUDA (the call itself is tested on the CPU above)")
    options = {"pe_type": encoding, **BIASED[encoding]}
    ids = tokens(2, 16)

    def run(setting, dtype):
        with fast_paths.recording() as ran:
            outputs = trained_pass(
                tiny_model(dtype=dtype, fast_paths=["attention-efficient"] if setting == "on" else [], **options),
                ids,
                "padded",
                seed=8,
            )
        assert ran == ({"attention-efficient"} if setting == "on" else set())
        return outputs

    compare_paths(run, DTYPE)


def test_attention_over_blocks_runs_where_it_pays(monkeypatch):
    """While autograd records, and on the CPU; on CUDA an inference pass whose whole bias is small enough builds it
    whole (one kernel call), and one whose bias would be too large goes a block at a time."""
    model = tiny_model("t5", fast_paths=["attention-blocks"], max_position_embeddings=512)
    ids = tokens(1, 200)
    for grad, limit in ((True, blocks.WHOLE_BIAS_LIMIT), (False, blocks.WHOLE_BIAS_LIMIT), (False, 0)):
        monkeypatch.setattr(blocks, "WHOLE_BIAS_LIMIT", limit)
        with torch.set_grad_enabled(grad), fast_paths.recording() as ran:
            model(ids)
        expected = grad or DEVICE.type == "cpu" or limit == 0
        assert ran == ({"attention-blocks"} if expected else set()), (grad, limit)


@pytest.mark.parametrize("encoding", ["cope", "path"])
def test_attention_over_blocks_keeps_no_n_by_n_tensor(encoding):
    """What it is for: CoPE's and PaTH's training steps keep far less for the backward pass (CoPE's gates, positions
    and interpolation weights, PaTH's logits and the pieces of their walk are N x T per head and layer)."""
    saved = {}
    for setting in ([], ["attention-blocks"]):
        model = tiny_model(encoding, num_hidden_layers=2, fast_paths=setting, max_position_embeddings=1024).train()
        saved[bool(setting)] = saved_bytes(model, tokens(1, 1000))
    assert saved[True] < saved[False] / 3, saved
