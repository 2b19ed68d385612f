"""A generic training loop on accelerate: AdamW, warm-up then cosine or constant, clipping, accumulation, mixed
precision, gradient checkpointing, periodic evaluation, JSONL metrics, atomic checkpoints and exact resume.

It knows nothing about tasks. Give it a model whose forward returns an object with `.loss`, a batch stream and
settings:

    from tapelm.experiments.train import TrainSettings, train
    settings = TrainSettings(steps=500, lr=1e-3, warmup=50, schedule="cosine", checkpoint_every=100)
    result = train(model, batch_stream, settings, "runs/my-run", evaluate_fn=None, resume=False)

`batch_stream(index) -> dict` returns the keyword arguments of one micro-batch for `model(**batch)` (e.g.
input_ids, labels, attention_mask). It must be a pure function of `index`: the loop asks process `rank` of
`world_size` for index `micro * world_size + rank`, where `micro` counts this process's micro-batches from 0 over the
whole run, so every process draws different batches and a resumed run draws exactly the batches an uninterrupted one
would. The data position saved in a checkpoint is `micro`.

Same command on one CPU, or under `accelerate launch` / `torchrun` (DDP; FSDP / DeepSpeed via an accelerate config).
A step's own code (`training_step`) reads nothing from the device; the loop reads the losses at log, evaluation and
checkpoint steps only, so the host does not wait for a GPU in between (the model's own reads aside: docs/GPU.md). On
CUDA batches are pinned and copied without blocking and AdamW is fused; `compile_step` compiles the forward for the
run's shapes (CUDA graphs where they hold).
Run directory layout (written by the main process only):

    settings.json          TrainSettings of the run (a resume with other settings is refused)
    metrics.jsonl          one JSON object per logged step / evaluation (truncated to the checkpoint on resume)
    checkpoints/step-N/    accelerate state (model.safetensors, optimizer, scheduler, RNG per rank) + manifest.json
    model/                 the final model (`save_pretrained` when the model has it, else model.safetensors)
    tensorboard/           local tracker logs, when the accelerator reports to TensorBoard (`trackers`)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from . import trackers

SCHEDULES = ("constant", "cosine", "polynomial", "wsd")
WSD_DECAY = 0.2  # the share of the steps over which "wsd" decays
MIXED_PRECISION = ("no", "bf16", "fp16")
CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_PATTERN = re.compile(r"^step-(\d{8})$")
MANIFEST = "manifest.json"

logger = logging.getLogger(__name__)

BatchStream = Callable[[int], Mapping[str, torch.Tensor]]
EvaluateFn = Callable[[torch.nn.Module, int], Mapping[str, Any]]


class CheckpointError(ValueError):
    """A checkpoint or run directory that cannot be used (corrupt, incomplete, or another configuration's)."""


@dataclass(frozen=True)
class TrainSettings:
    """Everything the loop needs besides the model and the data. Steps count optimizer updates.

    lr: peak learning rate of AdamW; warmup: linear warm-up steps from 0; schedule: "cosine" (decays to
    min_lr_ratio * lr at the last step), "polynomial" (power 1, as transformers' default polynomial schedule: a
    straight line from lr to min_lr_ratio * lr at the last step), "constant", or "wsd" (warm-up, stable, decay:
    constant, then a cosine to min_lr_ratio * lr over the last WSD_DECAY of the steps); batch_size: micro-batch size per
    process (informational for the loop, used by stream builders); grad_accum: micro-batches per update; clip: max
    global gradient norm (0 = no clipping); mixed_precision: "no" | "bf16" | "fp16"; grad_checkpointing: recompute
    activations in backward; eval_every / checkpoint_every: in steps (0 = only at the end / never during the run);
    keep_last: checkpoints kept; log_every: steps between metric lines; seed: seeds torch, numpy and random before
    the model's forward passes.
    """

    steps: int = 1000
    lr: float = 1e-3
    warmup: int = 100
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    batch_size: int = 32
    grad_accum: int = 1
    clip: float = 1.0
    mixed_precision: str = "no"
    grad_checkpointing: bool = False
    eval_every: int = 0
    checkpoint_every: int = 0
    keep_last: int = 2
    log_every: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        for name in ("steps", "batch_size", "grad_accum", "log_every", "keep_last"):
            _check_int(name, getattr(self, name), 1)
        for name in ("warmup", "eval_every", "checkpoint_every", "seed"):
            _check_int(name, getattr(self, name), 0)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not allowed; choose one of: {', '.join(SCHEDULES)}")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(
                f"mixed_precision={self.mixed_precision!r} is not allowed; choose one of: {', '.join(MIXED_PRECISION)}"
            )
        for name, low, high in (
            ("lr", 0.0, 10.0),
            ("min_lr_ratio", 0.0, 1.0),
            ("weight_decay", 0.0, 10.0),
            ("clip", 0.0, 1e9),
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"{name}={value!r} is not allowed; it must be a number in [{low}, {high}]")
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr!r} is not allowed; it must be positive")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas={self.betas!r} is not allowed; it must be two numbers in [0, 1)")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["betas"] = list(self.betas)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown training setting '{unknown[0]}'; choose from: {', '.join(sorted(known))}")
        return cls(**data)


def _check_int(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name}={value!r} is not allowed; it must be an integer >= {low}")


@dataclass
class TrainResult:
    """What a finished `train` call returns. `losses` are this run's per-step mean training losses (all processes
    averaged), indexed from the first step trained by this call (`start_step` + 1)."""

    run_dir: Path
    steps: int
    start_step: int
    losses: list[float] = field(default_factory=list)
    final_loss: float = float("nan")
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    world_size: int = 1
    tokens: int = 0


def learning_rate_lambda(settings: TrainSettings) -> Callable[[int], float]:
    """The multiplier of the peak learning rate after `step` updates: linear warm-up, then constant, cosine,
    polynomial (linear) decay, or constant followed by a cosine over the last WSD_DECAY of the steps ("wsd")."""

    def factor(step: int) -> float:
        if step < settings.warmup:
            return (step + 1) / (settings.warmup + 1)
        if settings.schedule == "constant":
            return 1.0
        start = settings.warmup
        if settings.schedule == "wsd":
            start = max(start, settings.steps - round(WSD_DECAY * settings.steps))
            if step < start:
                return 1.0
        span = max(1, settings.steps - start)
        progress = min(1.0, (step - start) / span)
        if settings.schedule == "polynomial":
            return settings.min_lr_ratio + (1 - settings.min_lr_ratio) * (1 - progress)
        return settings.min_lr_ratio + (1 - settings.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


# ---------------------------------------------------------------------------------------------------- checkpoints


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path, step: int, extra: Mapping[str, Any]) -> None:
    """Record every file of a checkpoint with its size and hash; written last, so its presence means complete."""
    files = {
        p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    payload = {"step": step, "files": files, **extra}
    temporary = directory / (MANIFEST + ".tmp")
    temporary.write_text(json.dumps(payload, indent=1))
    os.replace(temporary, directory / MANIFEST)


def verify_checkpoint(directory: Path) -> dict[str, Any]:
    """The manifest of a complete, intact checkpoint; CheckpointError naming the problem otherwise."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint '{directory}' is incomplete: it has no {MANIFEST}")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        int(manifest["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise CheckpointError(f"checkpoint '{directory}' is corrupt: {MANIFEST} is unreadable") from None
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint '{directory}' is incomplete: {name} is missing")
        if path.stat().st_size != expected["bytes"] or _sha256(path) != expected["sha256"]:
            raise CheckpointError(
                f"checkpoint '{directory}' is corrupt: {name} does not match its recorded size and hash"
            )
    return manifest


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of finished checkpoint folders, oldest first. Temporary folders of an interrupted write
    (`.step-N.tmp*`) never match."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := CHECKPOINT_PATTERN.match(p.name))]
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    """The newest finished checkpoint, verified; CheckpointError if it is corrupt or incomplete."""
    found = list_checkpoints(run_dir)
    if not found:
        return None
    step, path = found[-1]
    verify_checkpoint(path)
    return step, path


def newest_intact_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    """The newest checkpoint that verifies, with a warning for every newer one that does not (a resume from it
    overwrites them); CheckpointError when there are checkpoints and none is intact."""
    found = list_checkpoints(run_dir)
    problems = []
    for step, path in reversed(found):
        try:
            verify_checkpoint(path)
        except CheckpointError as error:
            problems.append(str(error))
            continue
        for problem in problems:
            logger.warning(
                "tapelm: %s; resuming from the intact '%s' instead (removing the damaged folder silences this)",
                problem,
                path,
            )
        return step, path
    if problems:
        raise CheckpointError(
            f"{problems[0]}, and no older checkpoint is intact; remove "
            f"'{Path(run_dir) / CHECKPOINT_DIR}' to start the run afresh"
        )
    return None


def _save_checkpoint(accelerator, run_dir: Path, step: int, micro: int, keep_last: int) -> Path:
    """accelerate's save_state into a temporary folder, a manifest, then one atomic rename."""
    root = run_dir / CHECKPOINT_DIR
    final = root / f"step-{step:08d}"
    temporary = root / f".step-{step:08d}.tmp"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        if temporary.exists():
            shutil.rmtree(temporary)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(temporary), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_manifest(temporary, step, {"data_position": micro, "world_size": accelerator.num_processes})
        if final.exists():
            shutil.rmtree(final)
        os.replace(temporary, final)
        for _, old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


# ---------------------------------------------------------------------------------------------------- the loop


def write_json_atomically(path: Path, payload: Any) -> None:
    """Write JSON through a temporary file and a rename: readers never see half a file."""
    write_text_atomically(path, json.dumps(payload, indent=2))


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines logged after `step` (an interrupted run logged past its last checkpoint)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the kill
        if record.get("step", 0) <= step:
            kept.append(line)
    write_text_atomically(path, "".join(line + "\n" for line in kept))


def write_text_atomically(path: Path, text: str) -> None:
    """Write text through a temporary file and a rename."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def check_run_dir(run_dir: Path, settings: TrainSettings, resume: bool) -> tuple[int, Path] | None:
    """Validate `run_dir` for a new run or a resume before anything is written; the checkpoint to resume from.

    Raises CheckpointError when the folder holds a run with other settings, a run without `resume`, or checkpoints
    none of which is intact (a damaged newest one falls back to the newest intact one, with a warning)."""
    run_dir = Path(run_dir)
    saved = run_dir / "settings.json"
    if saved.exists():
        try:
            previous = json.loads(saved.read_text())
        except json.JSONDecodeError:
            raise CheckpointError(f"run directory '{run_dir}' has an unreadable settings.json") from None
        if previous != settings.to_dict():
            changed = sorted(
                k for k in set(previous) | set(settings.to_dict()) if previous.get(k) != settings.to_dict().get(k)
            )
            raise CheckpointError(
                f"run directory '{run_dir}' belongs to another configuration (different "
                f"{', '.join(changed)}); choose another run directory"
            )
        if not resume:
            raise CheckpointError(
                f"run directory '{run_dir}' already holds a run; pass --resume to continue it "
                "or choose another run directory"
            )
    elif list_checkpoints(run_dir):
        raise CheckpointError(
            f"run directory '{run_dir}' holds checkpoints but no settings.json; it is not a tapelm run to resume"
        )
    return newest_intact_checkpoint(run_dir) if resume else None


def _model_save(accelerator, model, directory: Path) -> None:
    unwrapped = accelerator.unwrap_model(model)
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        temporary = directory.with_name("." + directory.name + ".tmp")
        if temporary.exists():
            shutil.rmtree(temporary)
        if hasattr(unwrapped, "save_pretrained"):
            from transformers.utils import logging as hf_logging

            shown = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()  # one shard: its bar is noise in the run's output
            try:
                unwrapped.save_pretrained(str(temporary), state_dict=state, safe_serialization=True)
            finally:
                if shown:
                    hf_logging.enable_progress_bar()
        else:
            from safetensors.torch import save_file

            temporary.mkdir(parents=True)
            save_file({k: v.contiguous() for k, v in state.items()}, str(temporary / "model.safetensors"))
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(temporary, directory)
    accelerator.wait_for_everyone()


def load_saved_model(directory: Path, model_class, **kwargs):
    """`model_class.from_pretrained(directory, **kwargs)`; ValueError naming the folder when its files cannot be
    read (a copy cut short, a disk that filled up)."""
    try:
        return model_class.from_pretrained(str(directory), **kwargs)
    except Exception as error:  # safetensors, json and torch each raise their own kinds
        reason = (str(error).strip().splitlines() or [""])[0][:200]
        raise ValueError(
            f"the model in '{directory}' cannot be read ({type(error).__name__}: {reason}); it is "
            "truncated or corrupt: write it again (rerun or --resume the command that made it)"
        ) from None


def make_accelerator(settings: TrainSettings, report_to: tuple[str, ...] = (), run_dir: Path | None = None):
    """The Accelerator `train` uses by default (the launch environment decides DDP / FSDP / devices); with
    `report_to`, it logs to those trackers (`trackers.check_report_to`), their local logs in `run_dir`."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    def build():
        return Accelerator(
            mixed_precision=settings.mixed_precision,
            step_scheduler_with_optimizer=False,
            **trackers.accelerator_options(report_to, run_dir),
        )

    try:
        return check_world(build())
    except ValueError as error:
        if "already been initialized" not in str(error) or PartialState().num_processes > 1:
            raise
    # One process that trained before with another precision (accelerate keeps one global state): start afresh.
    AcceleratorState._reset_state()
    return check_world(build())


def check_world(accelerator):
    """ValueError when a launcher started several processes but they did not form one group (accelerate on CPU
    without ACCELERATE_USE_CPU=1 silently runs each process alone)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise ValueError(
            f"the launcher started WORLD_SIZE={launched} processes but accelerate runs "
            f"{accelerator.num_processes}; on CPU set ACCELERATE_USE_CPU=1 (with accelerate launch "
            "--multi_gpu) so that the processes form one group"
        )
    return accelerator


def train(
    model: torch.nn.Module,
    batch_stream: BatchStream,
    settings: TrainSettings,
    run_dir: str | os.PathLike,
    evaluate_fn: EvaluateFn | None = None,
    resume: bool = False,
    parameters: list[torch.nn.Parameter] | None = None,
    progress: bool = True,
    accelerator=None,
    stop_after: int | None = None,
    evaluate_last: bool = True,
    data_workers: int = 0,
    compile_step: bool = False,
) -> TrainResult:
    """Train `model` for `settings.steps` optimizer updates and save it to `run_dir/model`.

    batch_stream: index -> keyword arguments of `model` for one micro-batch (see the module docstring).
    evaluate_fn(model, step) -> JSON-able dict: called on every process with the unwrapped model in eval mode every
    `eval_every` steps and after the last step (unless `evaluate_last` is False: the caller evaluates the final
    model itself, so only a last step on the `eval_every` schedule is evaluated); the main process's result is logged.
    resume: continue from the newest checkpoint in `run_dir` (a fresh start when there is none).
    parameters: the parameters to optimise (default: every parameter with requires_grad).
    accelerator: an `accelerate.Accelerator` to use (default: a new one from the settings and the launch environment).
    stop_after: stop (as if killed) after this many steps, leaving the checkpoints; for tests and time budgets.
    data_workers: make the micro-batches ahead in that many worker processes (the same batches in the same order;
    not a setting: it changes no number, only whether a GPU waits for the CPU to make its next batch).
    compile_step: compile the model for the run's fixed batch shapes (`compile_for_steps`); the same function to
    float rounding, so not a setting either.

    Between log steps the loop reads nothing from the device (`training_step`): token counts come from the batches'
    host copies, and the steps' losses are read at the next log, evaluation or checkpoint step. A non-finite loss
    therefore stops the run there, at the latest at the next log step, with a FloatingPointError naming the step it
    happened at and its loss (the steps after it ran on non-finite weights; no checkpoint is written from them).
    """
    from accelerate.utils import set_seed

    run_dir = Path(run_dir)
    _check_int("data_workers", data_workers, 0)
    checkpoint = check_run_dir(run_dir, settings, resume)
    accelerator = check_world(accelerator or make_accelerator(settings))
    set_seed(settings.seed)
    graphs = compile_step and accelerator.device.type == "cuda" and settings.grad_accum == 1
    model, optimizer, scheduler = _prepare(model, parameters, settings, accelerator, compile_step, graphs)
    start_step, micro, metrics_path = _restore(accelerator, run_dir, settings, checkpoint, resume)

    result = TrainResult(
        run_dir=run_dir, steps=settings.steps, start_step=start_step, world_size=accelerator.num_processes
    )
    rank, world = accelerator.process_index, accelerator.num_processes
    bar = tqdm(
        total=settings.steps,
        initial=start_step,
        desc=f"train {run_dir.name}",
        unit="step",
        disable=not (progress and accelerator.is_main_process),
        dynamic_ncols=True,
    )
    started = time.perf_counter()
    window_tokens, window_start = 0, time.perf_counter()
    unread: list[torch.Tensor] = []  # the mean losses of the steps since the last read, on the device
    last_step = settings.steps if stop_after is None else min(settings.steps, stop_after)
    pinned = accelerator.device.type == "cuda"
    batches = micro_batches(
        batch_stream,
        micro * world + rank,
        world,
        (last_step - start_step) * settings.grad_accum,
        data_workers,
        pin_memory=pinned,
    )
    model.train()
    step = start_step
    try:
        for step in range(start_step + 1, last_step + 1):
            host = [next(batches) for _ in range(settings.grad_accum)]
            micro += settings.grad_accum
            for batch in host:
                window_tokens = window_tokens + _token_count(batch)
            on_device = [{k: v.to(accelerator.device, non_blocking=pinned) for k, v in batch.items()} for batch in host]
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs are read already
            loss, grad_norm = training_step(model, on_device, accelerator, optimizer, scheduler, settings.clip)
            unread.append(loss)
            logged = step % settings.log_every == 0 or step in (1, last_step)  # the first loss is always logged
            evaluated = evaluate_fn is not None and (
                (settings.eval_every and step % settings.eval_every == 0) or (step == settings.steps and evaluate_last)
            )
            saved = settings.checkpoint_every and step % settings.checkpoint_every == 0 and step < settings.steps
            if logged or evaluated or saved:
                result.losses += read_losses(unread, step - len(unread) + 1)
                unread.clear()
            if logged:
                now = time.perf_counter()
                tokens = int(window_tokens) * world
                rate = tokens / max(now - window_start, 1e-9)
                result.tokens += tokens
                window_tokens, window_start = 0, now
                record = {
                    "step": step,
                    "loss": result.losses[-1],
                    "lr": scheduler.get_last_lr()[0],
                    "grad_norm": None if grad_norm is None else float(grad_norm),
                    "tokens_per_s": rate,
                    "elapsed_s": now - started,
                }
                _log(accelerator, metrics_path, record)
                bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{rate:,.0f}", refresh=False)
            bar.update(1)
            if evaluated:  # eagerly: a compiled step's shapes are not the evaluation's
                with torch.compiler.set_stance("force_eager") if compile_step else contextlib.nullcontext():
                    _evaluate(accelerator, model, evaluate_fn, step, metrics_path, result)
            if saved:
                _save_checkpoint(accelerator, run_dir, step, micro, settings.keep_last)
    finally:
        batches.close()
        bar.close()
    result.seconds = time.perf_counter() - started
    result.final_loss = result.losses[-1] if result.losses else float("nan")
    if step >= settings.steps:
        _save_checkpoint(accelerator, run_dir, settings.steps, micro, settings.keep_last)
        _model_save(accelerator, model, run_dir / "model")
    return result


def _prepare(model, parameters, settings: TrainSettings, accelerator, compile_step: bool, graphs: bool):
    """The model (gradient checkpointing enabled, compiled when asked, under CUDA graphs when `graphs`), its
    optimizer and scheduler, prepared by `accelerator`."""
    if settings.grad_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None) or getattr(
            model, "gradient_checkpointing_enable", None
        )  # transformers v5 renamed it
        if enable is None:
            raise ValueError("grad_checkpointing=True needs a model with activation_checkpointing_enable()")
        enable()
    params = [p for p in (parameters if parameters is not None else model.parameters()) if p.requires_grad]
    if not params:
        raise ValueError("there is no trainable parameter")
    optimizer = make_optimizer(params, settings, accelerator.device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, learning_rate_lambda(settings))
    if compile_step:
        compile_for_steps(model, graphs)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return model, optimizer, scheduler


def _restore(accelerator, run_dir: Path, settings: TrainSettings, checkpoint, resume: bool) -> tuple[int, int, Path]:
    """The step and data position to start from (a checkpoint's state loaded), with the run directory's
    settings.json written and its metrics.jsonl cut back to the start step; and that file's path."""
    start_step, micro = 0, 0
    if checkpoint is not None:
        start_step, path = checkpoint
        manifest = verify_checkpoint(path)
        if manifest.get("world_size", 1) != accelerator.num_processes:
            raise CheckpointError(
                f"checkpoint '{path}' was written by {manifest.get('world_size')} processes; "
                f"resume it with the same number (now {accelerator.num_processes})"
            )
        accelerator.load_state(str(path))
        micro = int(manifest["data_position"])
    metrics_path = run_dir / "metrics.jsonl"
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomically(run_dir / "settings.json", settings.to_dict())
        if resume:
            _truncate_metrics(metrics_path, start_step)
        elif metrics_path.exists():
            metrics_path.unlink()
    accelerator.wait_for_everyone()
    return start_step, micro, metrics_path


def make_optimizer(params: list[torch.nn.Parameter], settings: TrainSettings, device: torch.device):
    """AdamW with weight decay on the matrices only; fused on CUDA (a few kernel launches per step instead of
    several per parameter), foreach elsewhere (on the CPU the same numbers as the per-parameter loop)."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    implementation = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=settings.betas,
        **implementation,
    )


def training_step(
    model, batches: list[Mapping[str, torch.Tensor]], accelerator, optimizer, scheduler, clip: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer update over `batches` (the micro-batches of the step, on the device): forward and backward of
    each (gradients synchronised across processes on the last only), clipping to global norm `clip` (0: none), the
    optimizer and scheduler steps. Returns the step's mean loss over micro-batches and processes and the gradient
    norm before clipping (None without clipping), both on the device: its own code reads nothing from it (the model
    may: docs/GPU.md), so on a GPU the host runs ahead, queueing the next steps' kernels."""
    step_loss = torch.zeros((), device=accelerator.device)
    for index, batch in enumerate(batches):
        context = contextlib.nullcontext() if index == len(batches) - 1 else accelerator.no_sync(model)
        with context:
            loss = model(**batch).loss
            accelerator.backward(loss / len(batches))
        step_loss += loss.detach() / len(batches)
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip) if clip > 0 else None
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return accelerator.reduce(step_loss, reduction="mean"), grad_norm


def read_losses(losses: list[torch.Tensor], first_step: int) -> list[float]:
    """The values of the steps' losses (`first_step` onwards), read from the device at once; FloatingPointError
    naming the first step whose loss is not finite."""
    values = torch.stack(losses).tolist() if losses else []
    for step, value in enumerate(values, first_step):
        if not math.isfinite(value):
            raise FloatingPointError(
                f"training loss is {value} at step {step}; lower the learning rate or enable clipping"
            )
    return values


def _token_count(batch: Mapping[str, torch.Tensor]) -> torch.Tensor | int:
    """The real tokens of a micro-batch, counted where the batch is (its host copy: no device read)."""
    mask = batch.get("attention_mask")
    return mask.sum() if mask is not None else batch["input_ids"].numel()


def compile_for_steps(model: torch.nn.Module, graphs: bool) -> None:
    """torch.compile the model's forward (with its loss, hence its backward) for the shapes it is called with, with
    CUDA graphs when `graphs` (mode "reduce-overhead"): a step then launches a few graphs instead of hundreds of
    kernels. `train` asks for graphs on CUDA without gradient accumulation only: with it, a micro-batch's gradients
    might live in memory that the next micro-batch's graph rewrites (not tried on a GPU). Shapes are static until one
    changes (then one dynamic recompilation, not one per length). The forward is compiled before accelerate wraps it
    in autocast, and compiled code is keyed by code and shapes, not by the model object, so another model of the same
    configuration trained in this process reuses it: the compiler's caches are not reset, and dynamo may keep 64
    versions of the forward instead of 8 (past them it would run eagerly), so that a process training several
    configurations keeps each."""
    torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)
    model.forward = torch.compile(model.forward, mode="reduce-overhead" if graphs else None)


def _log(accelerator, metrics_path: Path, record: dict[str, Any]) -> None:
    if accelerator.is_main_process:
        with metrics_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
    trackers.log(accelerator, "train", {k: record[k] for k in ("loss", "lr", "tokens_per_s")}, record["step"])


class _Indexed(torch.utils.data.Dataset):
    """A batch stream as a dataset: item i is batch_stream(i)."""

    def __init__(self, batch_stream: BatchStream) -> None:
        self.batch_stream = batch_stream

    def __getitem__(self, index: int) -> Mapping[str, torch.Tensor]:
        return self.batch_stream(index)


def micro_batches(
    batch_stream: BatchStream, first: int, stride: int, count: int, workers: int = 0, pin_memory: bool = False
):
    """batch_stream(first), batch_stream(first + stride), ... (`count` of them); with `workers` > 0 made ahead, in
    order, by that many forked processes (the stream need not be picklable). `pin_memory`: the batches' tensors in
    page-locked memory, so that copies to a GPU run asynchronously (`.to(device, non_blocking=True)`)."""
    indices = range(first, first + stride * count, stride)
    if not workers:
        made = (batch_stream(index) for index in indices)
        return ({k: v.pin_memory() for k, v in batch.items()} for batch in made) if pin_memory else made
    from torch.utils.data import DataLoader

    loader = DataLoader(
        _Indexed(batch_stream),
        batch_size=None,
        sampler=indices,
        num_workers=workers,
        prefetch_factor=4,
        multiprocessing_context="fork",
        pin_memory=pin_memory,
    )
    return (batch for batch in loader)


def _evaluate(accelerator, model, evaluate_fn, step, metrics_path, result) -> None:
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.eval()
    with torch.no_grad():
        values = dict(evaluate_fn(unwrapped, step))
    unwrapped.train()
    if accelerator.is_main_process:
        record = {"step": step, "eval": values}
        with metrics_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
    trackers.log(accelerator, "eval", values, step)
    result.evaluations.append({"step": step, **values})
    accelerator.wait_for_everyone()


__all__ = [
    "TrainSettings",
    "TrainResult",
    "train",
    "make_accelerator",
    "check_world",
    "CheckpointError",
    "latest_checkpoint",
    "newest_intact_checkpoint",
    "load_saved_model",
    "list_checkpoints",
    "verify_checkpoint",
    "check_run_dir",
    "learning_rate_lambda",
    "micro_batches",
    "make_optimizer",
    "training_step",
    "read_losses",
    "compile_for_steps",
    "SCHEDULES",
    "MIXED_PRECISION",
]
