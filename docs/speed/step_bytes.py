"""The bytes and FLOPs of a training step, operation by operation, and the time they take at a GPU's peaks.

One forward and backward pass (no optimizer: the same for every row) of RoPE and TAPE at one of `bench speed`'s GPU
sizes, under bf16 autocast as `bench speed --dtype bf16` trains, run on the CPU: the same aten operations a GPU runs
on the same paths (without `--paths`, the reference paths), except the attention kernel's name. Every operation's
bytes (its tensor inputs read, its outputs written; views and allocations move none) and FLOPs (torch's FLOP
formulas; attention's with the causal half) are taken at batch 1 and 2, so each extrapolates exactly to the size's
batch (both are affine in it). Each operation then takes
max(FLOPs / peak, bytes / bandwidth) at the given peaks: the roofline, a lower bound on the step a GPU can run this
code in. A step's measured time above its roofline is kernels that run below the peaks; TAPE's roofline over
RoPE's is what this code asks of any GPU.

`--paths` counts the step with those fast paths on (the models' `fast_paths`), for both rows: the plain PyTorch ones
run as they are; "attention-unpadded" (CUDA's SDPA call without zero-padding q and k) counts its call forward and
backward as one operation each, moving q, k, v and the output (and their gradients) once with flash attention's
FLOPs; the Triton kernels of tapelm ("rotation-triton", "state-mixing-triton", "state-update-triton") and of fla
("rotation-fla", "norm-fla", "mlp-fla", "loss-fla": the rotary embedding, RMSNorm, SwiGLU, the output projection with
the loss) cannot run here, so they are taken as running on the CPU and each launch is counted as one operation moving
the bytes of the tensors it is handed (each element once: what the kernel reads and writes), its outputs left
unwritten (no byte count depends on values).

    python docs/speed/step_bytes.py [--sizes paper-1k ...] [--paths rotation-triton ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from tapelm.bench.speed import GPU_SIZES, SIZES, build_model
from tapelm.training.provenance import environment

aten = torch.ops.aten
ROWS = ("rope", "tape")
ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: False,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: True,
}
NO_TRAFFIC = {
    aten.detach.default,
    aten._unsafe_view.default,
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.new_empty_strided.default,
    aten.empty_strided.default,
    aten.new_empty.default,
}
MATRIX = {"mm", "bmm", "addmm", "baddbmm"}
PATHS = (
    "attention-unpadded",
    "rotation-autograd",
    "rotation-triton",
    "state-mixing-triton",
    "state-update-triton",
    "rotation-fla",
    "norm-fla",
    "mlp-fla",
    "loss-fla",
)
"""The fast paths `--paths` can count: those that RoPE's and TAPE's training steps take on CUDA and that run, or whose
kernels can be counted, on the CPU."""
H100 = {"bandwidth": 3.35e12, "bf16": 989e12, "float32": 67e12}
"""An H100 SXM's nominal peaks: HBM3 bytes/s, dense bf16 tensor-core FLOP/s, float32 FLOP/s (no tensor cores)."""


def attention_flops(func, args) -> float:
    """Causal flash attention's FLOPs: forward QK^T and PV; backward their recomputation and the four gradients."""
    q, k, v = args[1:4] if ATTENTION[func] else args[:3]
    batch, heads, queries, width = q.shape
    keys, value_width = k.shape[-2], v.shape[-1]
    per_pair = 3 * width + 2 * value_width if ATTENTION[func] else width + value_width
    return 2 * batch * heads * queries * keys * per_pair / 2


class Account(TorchDispatchMode):
    """Each operation's name, output dtype, bytes read and written, and FLOPs, in the order they run."""

    active: Account | None = None

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str, int, float]] = []

    def __enter__(self):
        Account.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        Account.active = None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func in NO_TRAFFIC:
            return out
        inputs = {id(x): x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)}
        outputs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        written = {id(x) for x in outputs}
        moved = sum(x.numel() * x.element_size() for key, x in inputs.items() if key not in written)
        moved += sum(x.numel() * x.element_size() for x in outputs)
        if func in ATTENTION:
            flops = attention_flops(func, args)
        elif func.overloadpacket in flop_registry:
            flops = flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
        else:
            flops = 0.0
        dtype = str(outputs[0].dtype).removeprefix("torch.") if outputs else "none"
        self.calls.append((func.overloadpacket.__name__, dtype, moved, float(flops)))
        return out


class CountedKernel:
    """Stands in for a Triton kernel: `kernel[grid](*args)` records one operation moving each tensor argument's
    elements once (a broadcast dimension, stride 0, read once) and writes nothing."""

    def __init__(self, name: str):
        self.name = name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            tensors = {id(x): x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)}.values()
            moved = sum(_distinct_elements(x) * x.element_size() for x in tensors)
            dtype = str(next(iter(tensors)).dtype).removeprefix("torch.")
            Account.active.calls.append((self.name, dtype, moved, 0.0))

        return launch


class CountedAttention(torch.autograd.Function):
    """Stands in for CUDA's SDPA call of "attention-unpadded" (q and k narrower than the value): one operation forward
    and one backward, each moving its tensors once with flash attention's causal FLOPs, as the memory-efficient and
    cuDNN kernels do; the CPU's math kernel computes the values, unseen by the account."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, is_causal, scale):
        with _disable_current_modes():
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale
            )
        ctx.save_for_backward(q, k, v, attn_mask)
        ctx.is_causal, ctx.scale = is_causal, scale
        _record("_scaled_dot_product_unpadded_attention", (q, k, v, attn_mask, out), q, k, v, backward=False)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, attn_mask = ctx.saved_tensors
        with _disable_current_modes(), torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            out = torch.nn.functional.scaled_dot_product_attention(
                *leaves, attn_mask=attn_mask, is_causal=ctx.is_causal, scale=ctx.scale
            )
            grads = torch.autograd.grad(out, leaves, grad)
        _record(
            "_scaled_dot_product_unpadded_attention_backward",
            (q, k, v, attn_mask, out, grad, *grads),
            q,
            k,
            v,
            backward=True,
        )
        return (*grads, None, None, None)


def _record(name: str, tensors, q, k, v, backward: bool) -> None:
    moved = sum(x.numel() * x.element_size() for x in tensors if x is not None)
    per_pair = 3 * q.shape[-1] + 2 * v.shape[-1] if backward else q.shape[-1] + v.shape[-1]
    flops = 2 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * per_pair / 2
    Account.active.calls.append((name, str(q.dtype).removeprefix("torch."), moved, float(flops)))


def counted_attention(q, k, v, attn_mask=None, is_causal=False, scale=None):
    return CountedAttention.apply(q, k, v, attn_mask, is_causal, scale)


def _distinct_elements(x: torch.Tensor) -> int:
    count = 1
    for size, stride in zip(x.shape, x.stride()):
        count *= size if stride else 1
    return count


@contextlib.contextmanager
def kernels_counted():
    """The Triton kernels of tapelm and of fla's fused modules taken as running on the CPU, for every tensor in the
    dtypes they take, each launch a `CountedKernel`; the unpadded attention call taken as running there, its SDPA call
    a `CountedAttention`."""
    import sys

    import fla.modules.activations
    import fla.modules.fused_linear_cross_entropy
    import fla.modules.norm.layernorm
    import fla.modules.rotary  # noqa: F401 (the modules whose kernels the fla paths launch)
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.jit import JITFunction

    import tapelm.kernels as kernels
    import tapelm.kernels.attention.unpadded as unpadded
    import tapelm.kernels.rotation as rotation
    import tapelm.kernels.state_mixing as state_mixing
    import tapelm.kernels.state_update as state_update
    from tapelm.kernels import FLA_DTYPES
    from tapelm.kernels.rotation import triton as rotation_kernels
    from tapelm.kernels.state_mixing import triton as mixing_kernels
    from tapelm.kernels.state_update import triton as update_kernels

    takes = [
        (rotation, "triton_takes"),
        (state_mixing, "triton_takes"),
        (state_update, "triton_takes"),
        (kernels, "fla_takes"),
    ]
    attention = [(unpadded, "takes"), (unpadded, "scaled_dot_product_attention")]
    kernels = [
        (module, name)
        for module in (rotation_kernels, mixing_kernels, update_kernels)
        + tuple(module for key, module in sys.modules.items() if key.startswith("fla.modules"))
        for name, value in vars(module).items()
        if isinstance(value, (JITFunction, Autotuner, Heuristics))
    ]
    originals = [(module, name, getattr(module, name)) for module, name in takes + attention + kernels]
    for module, name in takes:
        setattr(module, name, lambda x: x.dtype in FLA_DTYPES)
    unpadded.takes = lambda q, v: v.shape[-1] > q.shape[-1]
    unpadded.scaled_dot_product_attention = counted_attention
    for module, name in kernels:
        setattr(module, name, CountedKernel(name.removeprefix("_")))
    try:
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def step_calls(row: str, size_name: str, batch: int, paths: tuple[str, ...]) -> list[tuple[str, str, int, float]]:
    size = replace(SIZES[size_name], batch=batch)
    torch.manual_seed(0)
    model = build_model(size, row, list(paths)).train()
    ids = torch.randint(0, size.vocab, (batch, size.seq))
    account = Account()
    with kernels_counted() if paths else contextlib.nullcontext(), account:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
    return account.calls


def kind(name: str) -> str:
    if name.startswith("_scaled_dot_product"):
        return "attention"
    return "matrix products" if name in MATRIX else "element-wise and copies"


def extrapolated(one: list, two: list, batch: int) -> list[tuple[str, str, float, float]]:
    """Each call of a step at `batch` from the same call at batch 1 and 2 (bytes and FLOPs are affine in the batch).
    A call that runs at one of the two batches only (a copy of a few integers, as the loss's shifted labels need at
    batch 2) is scaled in proportion from where it ran."""
    key = [call[:2] for call in one], [call[:2] for call in two]
    calls = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, *key, autojunk=False).get_opcodes():
        if tag == "equal":
            for (name, dtype, bytes_1, flops_1), (_, _, bytes_2, flops_2) in zip(one[i1:i2], two[j1:j2]):
                calls.append(
                    (
                        name,
                        dtype,
                        bytes_1 + (batch - 1) * (bytes_2 - bytes_1),
                        flops_1 + (batch - 1) * (flops_2 - flops_1),
                    )
                )
            continue
        calls += [(name, dtype, moved * batch, flops * batch) for name, dtype, moved, flops in one[i1:i2]]
        calls += [(name, dtype, moved * batch / 2, flops * batch / 2) for name, dtype, moved, flops in two[j1:j2]]
    return calls


def roofline(row: str, size_name: str, paths: tuple[str, ...], peaks: dict) -> dict:
    """The row's step at the size's batch: per kind and per operation, calls, GB, TFLOPs and roofline ms."""
    one, two = (step_calls(row, size_name, batch, paths) for batch in (1, 2))
    batch = SIZES[size_name].batch
    parts = defaultdict(lambda: {"calls": 0, "GB": 0.0, "TFLOP": 0.0, "ms": 0.0})
    for name, dtype, moved, flops in extrapolated(one, two, batch):
        peak = peaks["bf16"] if dtype == "bfloat16" else peaks["float32"]
        seconds = max(flops / peak, moved / peaks["bandwidth"])
        for key in (kind(name), f"{name} ({dtype})"):
            part = parts[key]
            part["calls"] += 1
            part["GB"] += moved / 1e9
            part["TFLOP"] += flops / 1e12
            part["ms"] += seconds * 1e3
    kinds = {key: parts.pop(key) for key in ("attention", "matrix products", "element-wise and copies")}
    total = {field: sum(part[field] for part in kinds.values()) for field in ("calls", "GB", "TFLOP", "ms")}
    return {"total": total, "kinds": kinds, "operations": dict(sorted(parts.items(), key=lambda item: -item[1]["ms"]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(GPU_SIZES), choices=sorted(SIZES))
    parser.add_argument(
        "--paths",
        nargs="*",
        default=[],
        choices=PATHS,
        help="fast paths on, for both rows (default: none, as CUDA runs today)",
    )
    parser.add_argument("--out", type=Path, default=Path("docs/speed/step-bytes.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = {}
    for name in args.sizes:
        rows = {row: roofline(row, name, tuple(args.paths), H100) for row in ROWS}
        ratio = rows["tape"]["total"]["ms"] / rows["rope"]["total"]["ms"]
        sizes[name] = {"rows": rows, "tape_over_rope": ratio}
        print(
            f"{name}: RoPE {rows['rope']['total']['ms']:.1f} ms, TAPE {rows['tape']['total']['ms']:.1f} ms "
            f"(roofline at an H100's peaks), TAPE / RoPE {ratio:.3f}; GB {rows['rope']['total']['GB']:.1f} / "
            f"{rows['tape']['total']['GB']:.1f}"
        )
    words = ["python docs/speed/step_bytes.py --sizes", *args.sizes] + (["--paths", *args.paths] if args.paths else [])
    command = " ".join(words + ["--out", str(args.out)])
    record = {"command": command, "paths": args.paths, "peaks": H100, "sizes": sizes, "environment": environment()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
