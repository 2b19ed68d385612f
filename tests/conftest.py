"""Tiny models and helpers shared by the tests, and the device the law tests run on.

`pytest --device cuda` runs the tests marked `device` (equivalence to references, symmetries, cache parity, packing,
conversion exactness, bf16) on that device and skips every other test with its reason. On the CPU (the default,
and CI's) the `device` tests run with the tensors that a test or tapelm makes without naming a device put on the
`meta` device: they land on another device than the model, as they would on a GPU machine, and the test fails here
instead of passing on the CPU and crashing on the GPU.
"""

from __future__ import annotations

import collections
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from device_checks import OwnCodeElsewhere
from tapelm import TapeConfig, TapeForCausalLM, testing
from tapelm.positional import encoding_names

# `tapelm` flags of a run small enough for a test: addition to 2 digits (evaluated to 3), one layer of width 32, 6 steps
TINY_ADDITION = [
    "--steps",
    "6",
    "--batch-size",
    "8",
    "--warmup",
    "1",
    "--eval-n",
    "2",
    "--eval-every",
    "3",
    "--no-progress",
    "--task-option",
    "max_train_digits=2",
    "--task-option",
    "eval_max_digits=3",
    "--model-option",
    "hidden_size=32",
    "--model-option",
    "intermediate_size=48",
    "--model-option",
    "num_hidden_layers=1",
    "--model-option",
    "num_attention_heads=4",
    "--model-option",
    "num_key_value_heads=4",
]

VOCAB = 61
DEVICE = torch.device("cpu")
"""The device of the law tests (`--device`); set before the test modules are imported."""
WEIGHT_STD = 0.3
"""The scale of `randomize`'s weights, set with DEVICE (or `--weight-std`): 0.3 on the CPU, where the law tests run
in float64; 0.1 on a device, where they run in bf16. At 0.3 bf16 computes the tiny models' worst tensor to a median
42% of its norm (no comparison could see a wrong result there), at 0.1 to 2.4% (docs/gpu/bf16_conditioning.py)."""


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        default="cpu",
        help="device for the law tests marked `device` (cpu, cuda, cuda:1, ...); on another device "
        "than the CPU every other test is skipped with its reason (default: %(default)s)",
    )
    parser.addoption(
        "--weight-std",
        type=float,
        default=None,
        help="scale of the tiny models' random weights (default: 0.3 on the CPU, 0.1 on a device)",
    )


def pytest_configure(config):
    """The device the tests run on, and the marks transformers' own common tests use
    (tests/test_transformers_common.py), so they load without warnings."""
    global DEVICE, WEIGHT_STD
    DEVICE = torch.device(config.getoption("--device"))
    WEIGHT_STD = config.getoption("--weight-std")
    if WEIGHT_STD is None:
        WEIGHT_STD = 0.3 if DEVICE.type == "cpu" else 0.1
    if WEIGHT_STD <= 0:
        raise pytest.UsageError(f"--weight-std {WEIGHT_STD}: give a scale above 0")
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {DEVICE}: this PyTorch ({torch.__version__}) sees no CUDA device")
    if DEVICE.type not in ("cpu", "cuda"):
        raise pytest.UsageError(f"--device {DEVICE} is not supported; use cpu or cuda[:index]")
    if DEVICE.type == "cuda":
        _one_configuration_per_autotuned_kernel()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)  # one intra-op thread per worker: the workers, not threads, share the cores
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # pytest-xdist sends the files in the order `_costliest_first` gives
    config.addinivalue_line("markers", "device: a law test that runs on `pytest --device`")
    config.addinivalue_line("markers", "compiles: a test that runs torch.compile (no device-watching mode around it)")
    config.addinivalue_line(
        "markers",
        "own_process: a device test that calls Triton kernels (fla's, tapelm's): "
        "`tapelm doctor` runs each in a process of its own, since a fault there "
        "corrupts the process's CUDA context",
    )
    for mark in ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "torch_compile_test"):
        config.addinivalue_line("markers", f"{mark}: a mark of transformers' common tests")


def _one_configuration_per_autotuned_kernel():
    """Each Triton kernel a library autotunes (fla's) compiles its first configuration only. The law tests check the
    function, which no configuration changes; autotuning every kernel in every pytest worker took minutes on the H100
    (docs/gpu/h100-2026-11-26-b/). Set before fla is imported, which builds its autotuners as it loads."""
    import sys

    from triton.runtime.autotuner import Autotuner

    assert "fla" not in sys.modules, "fla was imported before the law tests could set its autotuning"
    build = Autotuner.__init__

    def first_configuration(self, fn, arg_names, configs, *args, **kwargs):
        build(self, fn, arg_names, configs[:1], *args, **kwargs)

    Autotuner.__init__ = first_configuration


def pytest_runtest_logreport(report):
    _record_skip(report)


def pytest_collectreport(report):
    _record_skip(report)


def _outside_ci_subset(item) -> bool:
    rule = getattr(getattr(item, "module", None), "outside_ci_subset", None)
    return rule is not None and rule(item)


def _record_skip(report) -> None:
    """With TAPELM_RECORD_SKIPS=FILE, append the id of every skipped test or module to FILE: CI runs them again once
    the extras are installed (.ci/run). In the controlling process only, where xdist's workers report."""
    path = os.environ.get("TAPELM_RECORD_SKIPS")
    if path and report.skipped and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as file:
            file.write(report.nodeid + "\n")


# The files that take longest, costliest first (each file's summed `pytest --durations=0` times, 2026-11-29: 81 s
# down to 15 s). pytest-xdist hands whole files (`--dist loadfile`) to whichever worker is free, by default the files
# with the most tests first, which left these to the end and one worker running them alone for about a minute.
COSTLIEST_FILES = (
    "test_train.py",
    "test_bench.py",
    "test_compare.py",
    "test_launchers.py",
    "test_convert.py",
    "test_cache.py",
    "test_stage.py",
    "test_train_distributed.py",
    "test_fast_paths.py",
    "test_export.py",
    "test_sources.py",
    "test_lm_eval.py",
    "test_fsdp.py",
    "test_state_update.py",
    "test_rotation_kernels.py",
    "test_sharing.py",
)


def _costliest_first(items: list) -> list:
    """`items` with whole files reordered: `COSTLIEST_FILES` first, then the others by number of tests."""
    counts = collections.Counter(item.path.name for item in items)

    def rank(item):
        name = item.path.name
        return (COSTLIEST_FILES.index(name), 0) if name in COSTLIEST_FILES else (len(COSTLIEST_FILES), -counts[name])

    return sorted(items, key=lambda item: (rank(item), str(item.path)))  # stable: each file keeps its own order


def pytest_collection_modifyitems(config, items):
    """Deselect what a test module's `outside_ci_subset(item)` leaves out of CI's budget; send the costliest files
    first; on a device, skip every test that is not a `device` law test."""
    outside = [item for item in items if _outside_ci_subset(item)]
    if outside:
        config.hook.pytest_deselected(items=outside)
        left_out = set(outside)
        items[:] = [item for item in items if item not in left_out]
    items[:] = _costliest_first(items)
    if DEVICE.type == "cpu":
        return
    skip = pytest.mark.skip(reason=f"runs on the CPU only: not one of the law tests `--device {DEVICE}` runs")
    for item in items:
        if "device" not in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _default_device_elsewhere(request):
    """On the CPU, `device` tests put what tests and tapelm make without a device on `meta` (module docstring); not
    while torch.compile traces (marked `compiles`: dynamo would trace the mode itself)."""
    if DEVICE.type == "cpu" and "device" in request.keywords and "compiles" not in request.keywords:
        with OwnCodeElsewhere():
            yield
    else:
        yield


def tiny_config(pe_type: str = "tape", **overrides) -> TapeConfig:
    """A few-thousand-parameter model: 2 layers, 4 heads of dim 8 (2 KV heads), as the conformance kit's
    (`tapelm.testing.tiny_config`). RandPE evaluates on the given positions there, so that it obeys the
    deterministic laws (its random evaluation has its own tests)."""
    return testing.tiny_config(pe_type, **overrides)


def randomize(model: torch.nn.Module, std: float | None = None, seed: int = 0) -> torch.nn.Module:
    """`tapelm.testing.randomize` at the scale of the test device (`WEIGHT_STD`) unless `std` says otherwise."""
    return testing.randomize(model, WEIGHT_STD if std is None else std, seed)


def new_model(config: TapeConfig, seed: int = 0, device: torch.device | None = None) -> TapeForCausalLM:
    """`TapeForCausalLM(config)` built on the test device (or `device`), in eval mode, from `seed`."""
    torch.manual_seed(seed)
    with torch.device(device or DEVICE):
        return TapeForCausalLM(config).eval()


def tiny_model(
    pe_type: str = "tape", dtype=torch.float32, seed: int = 0, std: float | None = None, **overrides
) -> TapeForCausalLM:
    """A tiny model with random non-zero weights (`randomize`) on the test device."""
    return randomize(new_model(tiny_config(pe_type, **overrides), seed), std, seed).to(dtype).eval()


def first_layer_logits(model, x: torch.Tensor, layer_idx: int = 0) -> torch.Tensor:
    """Decoder layer `layer_idx`'s pre-softmax logits (B, H, T, T) for its attention input x (B, T, C), through the
    positional hooks the decoder calls (no cache, positions 0..T-1), -inf where the causal mask hides a key; each KV
    head's keys serve its group of query heads."""
    from tapelm.fast_paths import NONE
    from tapelm.kernels.attention import materialized
    from tapelm.positional import PositionContext

    layer = model.model.layers[layer_idx]
    attention, positional = layer.self_attn, layer.positional
    batch, length, _ = x.shape
    dim = model.config.head_dim
    q, k, v = (
        proj(x).view(batch, length, -1, dim).transpose(1, 2)
        for proj in (attention.q_proj, attention.k_proj, attention.v_proj)
    )
    positions = torch.arange(length, device=x.device).expand(batch, -1)
    ctx = PositionContext(query_positions=positions, key_positions=positions, paths=NONE)
    model.model.positional.prepare(ctx, x.dtype)
    valid = torch.ones(1, 1, length, length, dtype=torch.bool, device=x.device).tril()
    q, k = positional.transform_qk(q, k, None, ctx)
    q, k, _, bias = positional.attention_inputs(x, q, k, v, dim, None, layer_idx, valid, ctx)
    logits = q @ k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(-1, -2) * positional.logit_scale(dim)
    if bias is not None:
        logits = logits + materialized(bias)
    return logits.masked_fill(~valid, float("-inf"))


decode_in_chunks = testing.decode_in_chunks


def run_under_triton_interpreter(script: str) -> None:
    """Run `script` in a fresh Python at the repository root under Triton's CPU interpreter (TRITON_INTERPRET=1,
    which must be set before Triton is imported); fail with the end of its stderr."""
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]


def check_triton_kernels(module: str, *device_checks: str) -> None:
    """Run a kernel test module's checks: `check_kernels(device, dtype, tolerance)`, `check_models(device, dtype)` and
    each of `device_checks(device)`. On CUDA compiled, the kernels in float32 and bf16 and the models in bf16; on the
    CPU under Triton's interpreter in float64."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install tapelm[gpu])")
    if DEVICE.type == "cuda":
        checks = importlib.import_module(module)
        checks.check_kernels(DEVICE, torch.float32, 1e-5)
        checks.check_kernels(DEVICE, torch.bfloat16, 3e-2)
        for name in device_checks:
            getattr(checks, name)(DEVICE)
        checks.check_models(DEVICE, torch.bfloat16)
        return
    calls = [
        "t.check_kernels(cpu, torch.float64, 1e-12)",
        *(f"t.{name}(cpu)" for name in device_checks),
        "t.check_models(cpu, torch.float64)",
    ]
    run_under_triton_interpreter(
        f"import sys, torch; sys.path.insert(0, 'tests'); import {module} as t; "
        f"cpu = torch.device('cpu'); {'; '.join(calls)}"
    )


def tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Random token ids on the test device (drawn on the CPU: the same ids on every device)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=generator, device="cpu").to(DEVICE)


@pytest.fixture(params=encoding_names())
def pe_type(request) -> str:
    """Every registered encoding: tapelm's own and those installed packages register."""
    return request.param
