"""`tapelm doctor`: one command for a visit to a GPU machine, writing one JSON record.

On the device accelerate gives this process (the GPU when there is one), in five parts, each recorded whether it
passes or fails, so one failing part does not hide the others:

1. tests: the law tests on the device (`pytest --device DEVICE -m device`, from the source checkout's tests/), those
   that call Triton kernels in a few processes beside the others, a process that faults or dies rerun from the test
   after it in a fresh one, so that a fault that corrupts the CUDA context fails one test (device_tests.py); the
   record is written after each test's result, so a visit cut short keeps every result it got;
2. first-calls: each fast path's first training step on a small model, its compiling and autotuning, and whether
   decoding at a new length tunes again (first_calls.py);
3. speed: `tapelm bench speed` for TAPE, RoPE and transformers' Llama at the GPU sizes, under bf16 autocast, with
   every fast path the device offers (`--fast-paths on`) when the law tests (which run them) passed, else with the
   verified ones only;
4. training: a short `--preset paper` run of TAPE and of RoPE on MQAR, evaluated over lengths;
5. generation: each trained model's greedy decoding with a cache equals decoding without one; its tokens/s.

`--tiny` (the default on the CPU, and what CI runs) is the same code at tiny sizes: a few test files, the tiny
benchmark size, a tiny model with the paper preset's training settings. The command exits 1 when a part failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..bench import speed
from ..experiments.runs import RunOptions, RunSpec, load_run, run_task
from ..training.devices import process_device
from ..training.provenance import environment
from .device_tests import PytestRun, collected, lanes
from .first_calls import run_first_calls

PARTS = ("tests", "first-calls", "speed", "training", "generation")
ENCODINGS = ("tape", "rope")
TINY_MODEL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tape_position_size": 8,
}
TINY_TESTS = tuple(
    test
    for pe in ("tape", "rope", "grape-ap")
    for test in (
        f"test_conformance.py::test_every_encoding_obeys_every_law[{pe}-cache_step]",
        f"test_equivalence.py::test_sdpa_equals_eager_reference[{pe}]",
        f"test_conformance.py::test_every_encoding_obeys_every_law[{pe}-packed_documents]",
    )
)
"""The law tests `--tiny` runs: cache parity, the fused path against the explicit one, packing, for TAPE, RoPE and
an encoding with a logit bias (the suite runs them for every encoding; the tiny run checks the doctor's own
machinery)."""


def source_tests() -> Path | None:
    """The tests/ folder of the source checkout tapelm runs from (None for an installed package)."""
    tests = Path(__file__).resolve().parents[3] / "tests"
    return tests if (tests / "conftest.py").is_file() else None


OWN_ARGUMENTS = ["--stop-at-cuda-error", "-vv"]
"""A process of own-process tests stops after a test that failed with a CUDA error (pytest_events.py): what it had
not started runs on in a fresh one."""


@dataclass(frozen=True)
class DeviceTestSettings:
    """How the law tests run on a device: the shared ones on `workers` pytest-xdist workers (where it is installed),
    those marked `own_process` in `processes` processes of their own beside them; `select`, a pytest -k expression;
    past `seconds` every process is stopped and what did not finish is recorded so."""

    workers: int = 1
    processes: int = 4
    select: str | None = None
    seconds: float | None = None


def run_tests(
    device: torch.device,
    tiny: bool,
    log: Path,
    settings: DeviceTestSettings = DeviceTestSettings(),
    progress: Callable[[dict], None] = lambda partial: None,
) -> dict:
    """The law tests on `device` in pytest processes (device_tests.py), the results so far handed to `progress` as
    each comes in, the shared run's output written to `log` as it runs (the other processes' beside it, in
    LOG-processes/)."""
    tests = source_tests()
    if tests is None:
        return {
            "status": "skipped",
            "reason": "the law tests live in the source checkout's tests/, which this installed tapelm does not have",
        }
    common = [
        "--device",
        str(device),
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(tests.parent),
        *(["-k", settings.select] if settings.select else []),
    ]
    run = PytestRun(
        tests.parent,
        log.with_name(log.stem + "-processes"),
        None if settings.seconds is None else time.monotonic() + settings.seconds,
        progress,
    )
    own, collecting = [], None
    if tiny:
        run.start("shared", [*(str(tests / name) for name in TINY_TESTS), "-q", "--durations=20", *common], log=log)
    else:
        parallel = ["-n", str(settings.workers)] if settings.workers > 1 and importlib.util.find_spec("xdist") else []
        run.start(
            "shared",
            [str(tests), "-m", "device and not own_process", "-vv", "--durations=20", *parallel, *common],
            log=log,
        )
        own, collecting = collected(tests.parent, [str(tests), "-m", "device and own_process", *common])
        for number, group in enumerate(lanes(own, settings.processes), 1):
            run.start(f"own-{number}", OWN_ARGUMENTS + common, group)
    run.wait(OWN_ARGUMENTS + common)
    summary = run.summary()
    shared = next(process for process in summary["processes"] if process["name"] == "shared")
    if collecting is not None:
        summary["failures"].append(f"ERROR collecting the own-process tests: {collecting}")
    passed = (
        shared["exit"] in (0, 5)
        and not summary["failures"]  # 5: nothing selected (a -k expression)
        and not {"failed", "error", "not run"} & summary["counts"].keys()
    )
    text = log.read_text()
    return {
        "status": "passed" if passed else "failed",
        **summary,
        "failures": summary["failures"][:50],
        "own_process": len(own),
        "selection": "tiny" if tiny else "-m device",
        "log": log.name,
        **({} if passed else {"output_tail": text[-4000:]}),
    }


def run_speed(device: torch.device, tiny: bool, out: Path, fast_paths: str = "auto") -> dict:
    """bench speed for TAPE, RoPE and Llama with the given fast-path setting: the tiny size, or the GPU sizes with 3
    repetitions."""
    sizes = (
        [speed.SIZES["tiny"]]
        if tiny
        else [replace(speed.SIZES[name], repeats=3, decode_tokens=32) for name in speed.GPU_SIZES]
    )
    report = speed.run(
        sizes,
        ["rope", "tape", "llama"],
        out,
        speed.Options(device, bf16=True, fast_paths=fast_paths),
        progress=False,
        stem="doctor-speed",
    )
    return {
        "status": "passed",
        "fast_paths": fast_paths,
        "sizes": {
            name: {
                "ratios_to_rope": entry["ratios_to_rope"],
                "results": {
                    row: {k: v for k, v in result.items() if k != "samples"} for row, result in entry["results"].items()
                },
            }
            for name, entry in report["sizes"].items()
        },
    }


def training_spec(pe: str, tiny: bool) -> RunSpec:
    """MQAR with the paper preset's training settings (bf16 autocast), a few steps; a tiny model with `tiny`."""
    if tiny:
        return RunSpec(
            task="mqar",
            pe=pe,
            preset="paper",
            model_options=TINY_MODEL,
            eval_n=4,
            eval_batch_size=4,
            train_options={
                "steps": 4,
                "batch_size": 4,
                "grad_accum": 1,
                "warmup": 1,
                "log_every": 1,
                "eval_every": 0,
                "checkpoint_every": 0,
            },
        )
    return RunSpec(
        task="mqar",
        pe=pe,
        preset="paper",
        eval_n=32,
        eval_batch_size=32,
        train_options={
            "steps": 30,
            "batch_size": 32,
            "grad_accum": 1,
            "warmup": 5,
            "log_every": 5,
            "eval_every": 0,
            "checkpoint_every": 0,
        },
    )


def run_training(tiny: bool, runs: Path) -> dict:
    """A short paper-preset run of each encoding; its losses, evaluation and time."""
    results = {}
    for pe in ENCODINGS:
        started = time.perf_counter()
        result = run_task(training_spec(pe, tiny), runs / pe, RunOptions(progress=False))
        results[pe] = {
            "seconds": time.perf_counter() - started,
            "first_loss": result["first_loss"],
            "final_loss": result["final_loss"],
            "metric": result["metric"],
            "summary": result["summary"],
            "parameters": result["parameters"],
        }
    return {"status": "passed", "runs": results}


@torch.no_grad()
def run_generation(device: torch.device, runs: Path, new_tokens: int) -> dict:
    """Each trained model decodes a batch of its task's prompts greedily with and without a cache: equal outputs,
    and the cached decoding's tokens/s."""
    results, status = {}, "passed"
    for pe in ENCODINGS:
        run = load_run(runs / pe)
        model = run.load_model(runs / pe).to(device).eval()
        condition = run.task.eval_conditions()[0]
        batch = next(iter(run.task.eval_batches(condition, 0, 4, 4)))
        ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
        options = dict(
            attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        cached = model.generate(ids, use_cache=True, **options)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - started
        uncached = model.generate(ids, use_cache=False, **options)
        equal = torch.equal(cached, uncached)
        status = status if equal else "failed"
        results[pe] = {
            "cached_equals_uncached": equal,
            "batch": ids.shape[0],
            "prompt_tokens": ids.shape[1],
            "new_tokens": new_tokens,
            "cached_tokens_per_s": ids.shape[0] * new_tokens / seconds,
        }
    return {"status": status, "models": results}


def _speed_fast_paths(record: dict) -> str:
    """ "on" when the law tests passed on this device (they run every fast path on), else "auto"."""
    return "on" if record["parts"].get("tests", {}).get("status") == "passed" else "auto"


def run_doctor(
    out: Path, tiny: bool, skip: tuple[str, ...] = (), tests: DeviceTestSettings = DeviceTestSettings()
) -> dict:
    """Every part on this process's device; the record, also written to `out`/doctor-<device>.json after each
    part and each test's result. A part that raises is recorded as failed with its traceback; the others still
    run."""
    device = process_device()
    name = "cpu" if device.type == "cpu" else re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name(device))
    path = out / f"doctor-{name.strip('-').lower()}{'-tiny' if tiny else ''}.json"
    out.mkdir(parents=True, exist_ok=True)
    record = {"environment": environment(), "device": speed.device_record(device), "tiny": tiny, "parts": {}}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tapelm-doctor-") as scratch:
        runs = Path(scratch)

        def so_far(part: str) -> Callable[[dict], None]:
            """Where a part hands its results so far: into the record on disk."""

            def save(partial: dict) -> None:
                record["parts"][part] = {"status": "running", **partial}
                _save(path, record)

            return save

        parts = {
            "tests": lambda: run_tests(device, tiny, path.with_name(path.stem + "-tests.log"), tests, so_far("tests")),
            "first-calls": lambda: run_first_calls(device, tiny, so_far("first-calls")),
            "speed": lambda: run_speed(device, tiny, runs / "speed", _speed_fast_paths(record)),
            "training": lambda: run_training(tiny, runs),
            "generation": lambda: run_generation(device, runs, 8 if tiny else 64),
        }
        for part, function in parts.items():
            if part in skip or (part == "generation" and "training" in skip):
                record["parts"][part] = {"status": "skipped", "reason": "--skip"}
            else:
                record["parts"][part] = _run_part(part, function)
            record["seconds"] = time.perf_counter() - started
            _save(path, record)
    print(f"wrote {path}")
    return record


def _run_part(part: str, function: Callable[[], dict]) -> dict:
    """The result of one part, with its seconds; a part that raises is recorded as failed with its traceback."""
    started = time.perf_counter()
    print(f"doctor: {part} ...", flush=True)
    try:
        result = function()
    except Exception as error:  # a failing part is recorded; the others still run
        result = {
            "status": "failed",
            "error": f"{type(error).__name__}: {error}",
            "traceback": traceback.format_exc()[-4000:],
        }
    result["seconds"] = time.perf_counter() - started
    print(f"doctor: {part} {result['status']} ({result['seconds']:.0f} s)", flush=True)
    return result


def _save(path: Path, record: dict) -> None:
    """Write `record` to `path` whole (a reader never sees half of it)."""
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(record, indent=1))
    temporary.replace(path)


def _doctor(args: argparse.Namespace) -> int:
    unknown = [part for part in args.skip if part not in PARTS]
    if unknown:
        raise ValueError(f"--skip {unknown[0]!r} is not a part; choose from {', '.join(PARTS)}")
    for option in ("workers", "processes", "seconds"):
        value = getattr(args, option)
        if value is not None and value <= 0:
            raise ValueError(f"--{option}={value} is not allowed; it must be positive")
    tiny = args.tiny or process_device().type == "cpu"
    record = run_doctor(
        Path(args.out),
        tiny,
        tuple(args.skip),
        DeviceTestSettings(args.workers, args.processes, args.select, args.seconds),
    )
    failed = [part for part, result in record["parts"].items() if result["status"] == "failed"]
    if failed:
        print(f"tapelm: doctor: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def add_commands(commands) -> None:
    """Register `tapelm doctor`."""
    parser = commands.add_parser(
        "doctor",
        help="one command for a GPU visit: the law tests on the device, bench speed at the GPU sizes, a "
        "short paper-preset training of TAPE and RoPE, cached generation; one JSON",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--out", default="docs/gpu", help="folder for the JSON record (default: %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (the default on the CPU)")
    parser.add_argument("--skip", nargs="+", default=[], metavar="PART", help=f"parts to skip: {', '.join(PARTS)}")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="pytest-xdist workers for the shared law tests on a device (default: %(default)s)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=4,
        help="processes for the law tests that run apart from the shared ones (marked own_process: "
        "they call Triton kernels), beside them; one that faults or dies is rerun from the test "
        "after it in a fresh one (default: %(default)s)",
    )
    parser.add_argument(
        "--seconds", type=float, help="stop the law tests after this many seconds, recording what did not finish"
    )
    parser.add_argument(
        "--select",
        metavar="EXPRESSION",
        help="only the law tests this pytest -k expression selects (e.g. a rerun of those that failed)",
    )
    parser.set_defaults(handler=_doctor)
