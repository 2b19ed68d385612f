"""A generic training loop on accelerate: AdamW, warm-up then cosine or constant, clipping, accumulation, mixed
precision, gradient checkpointing, periodic evaluation, JSONL metrics, atomic checkpoints (every N steps, or every M
minutes of training) and exact resume.

It knows nothing about tasks. Give it a model whose forward returns an object with `.loss`, a batch stream and
settings:

    from tapelm.training.loop import train
    from tapelm.training.settings import TrainSettings
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
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from . import trackers
from .accelerator import check_world, make_accelerator
from .atomic import write_json_atomically, write_text_atomically
from .checkpoints import CheckpointError, check_run_dir, save_checkpoint, verify_checkpoint
from .saved_models import save_model
from .schedule import learning_rate_lambda
from .settings import TrainSettings, check_int
from .step import BatchStream, compile_for_steps, make_optimizer, micro_batches, read_losses, token_count, training_step

EvaluateFn = Callable[[torch.nn.Module, int], Mapping[str, Any]]


@dataclass
class TrainResult:
    """What a finished `train` call returns. `losses` are this run's per-step mean training losses (all processes
    averaged), indexed from the first step trained by this call (`start_step` + 1); `seconds` this call's training,
    `earlier_seconds` the run's before it (recorded in the checkpoint it resumed from; 0 from the start, or from a
    checkpoint written before checkpoints recorded it)."""

    run_dir: Path
    steps: int
    start_step: int
    losses: list[float] = field(default_factory=list)
    final_loss: float = float("nan")
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    earlier_seconds: float = 0.0
    world_size: int = 1
    tokens: int = 0


@dataclass(frozen=True)
class LoopOptions:
    """How `train` runs, none of it a setting: none changes a number the run computes.

    progress: a progress bar (on the main process).
    stop_after: stop (as if killed) after this many steps, leaving the checkpoints; for tests and time budgets.
    evaluate_last: also evaluate after the last step; False when the caller evaluates the final model itself, so
    only a last step on the `eval_every` schedule is evaluated.
    data_workers: make the micro-batches ahead in that many worker processes (the same batches in the same order;
    only whether a GPU waits for the CPU to make its next batch).
    compile_step: compile the model for the run's fixed batch shapes (`compile_for_steps`) with torch.compile's
    `compile_backend`; the same function to float rounding.
    checkpoint_minutes: also write a checkpoint at the first log step at least that many minutes (wall clock, the
    main process's) after the previous one or the start of the call (0: only `checkpoint_every`'s); a run resumed
    from one ends as an unbroken run does.
    """

    progress: bool = True
    stop_after: int | None = None
    evaluate_last: bool = True
    data_workers: int = 0
    compile_step: bool = False
    compile_backend: str = "inductor"
    checkpoint_minutes: float = 0.0

    def __post_init__(self) -> None:
        check_int("data_workers", self.data_workers, 0)
        check_minutes(self.checkpoint_minutes)


def train(
    model: torch.nn.Module,
    batch_stream: BatchStream,
    settings: TrainSettings,
    run_dir: str | os.PathLike,
    evaluate_fn: EvaluateFn | None = None,
    resume: bool = False,
    parameters: list[torch.nn.Parameter] | None = None,
    accelerator=None,
    options: LoopOptions | None = None,
) -> TrainResult:
    """Train `model` for `settings.steps` optimizer updates and save it to `run_dir/model`.

    batch_stream: index -> keyword arguments of `model` for one micro-batch (see the module docstring).
    evaluate_fn(model, step) -> JSON-able dict: called on every process with the unwrapped model in eval mode every
    `eval_every` steps and after the last step (see `LoopOptions.evaluate_last`); the main process's result is logged.
    resume: continue from the newest checkpoint in `run_dir` (a fresh start when there is none).
    parameters: the parameters to optimise (default: every parameter with requires_grad).
    accelerator: an `accelerate.Accelerator` to use (default: a new one from the settings and the launch environment).
    options: how the loop runs (default `LoopOptions()`).

    Between log steps the loop reads nothing from the device (`training_step`): token counts come from the batches'
    host copies, and the steps' losses are read at the next log, evaluation or checkpoint step. A non-finite loss
    therefore stops the run there, at the latest at the next log step, with a FloatingPointError naming the step it
    happened at and its loss (the steps after it ran on non-finite weights; no checkpoint is written from them).
    """
    from accelerate.utils import set_seed

    run_dir = Path(run_dir)
    options = options or LoopOptions()
    checkpoint = check_run_dir(run_dir, settings, resume)
    accelerator = check_world(accelerator or make_accelerator(settings))
    set_seed(settings.seed)
    graphs = options.compile_step and options.compile_backend == "inductor" and accelerator.device.type == "cuda"
    graphs = graphs and settings.grad_accum == 1
    step_backend = options.compile_backend if options.compile_step else None
    model, optimizer, scheduler = _prepare(model, parameters, settings, accelerator, step_backend, graphs)
    start_step, micro, earlier, metrics_path = _restore(accelerator, run_dir, settings, checkpoint, resume)

    result = TrainResult(
        run_dir=run_dir,
        steps=settings.steps,
        start_step=start_step,
        earlier_seconds=earlier,
        world_size=accelerator.num_processes,
    )
    rank, world = accelerator.process_index, accelerator.num_processes
    bar = tqdm(
        total=settings.steps,
        initial=start_step,
        desc=f"train {run_dir.name}",
        unit="step",
        disable=not (options.progress and accelerator.is_main_process),
        dynamic_ncols=True,
    )
    started = last_saved = time.perf_counter()
    window_tokens, window_start = 0, time.perf_counter()
    unread: list[torch.Tensor] = []  # the mean losses of the steps since the last read, on the device
    last_step = settings.steps if options.stop_after is None else min(settings.steps, options.stop_after)
    pinned = accelerator.device.type == "cuda"
    batches = micro_batches(
        batch_stream,
        micro * world + rank,
        world,
        (last_step - start_step) * settings.grad_accum,
        options.data_workers,
        pin_memory=pinned,
    )
    model.train()
    step = start_step
    try:
        for step in range(start_step + 1, last_step + 1):
            host = [next(batches) for _ in range(settings.grad_accum)]
            micro += settings.grad_accum
            for batch in host:
                window_tokens = window_tokens + token_count(batch)
            on_device = [{k: v.to(accelerator.device, non_blocking=pinned) for k, v in batch.items()} for batch in host]
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs are read already
            loss, grad_norm = training_step(model, on_device, accelerator, optimizer, scheduler, settings.clip)
            unread.append(loss)
            # The first and last losses are always logged; a stop (`stop_after`) logs no line of its own, so that a
            # run stopped and resumed logs the unbroken run's lines.
            logged = step % settings.log_every == 0 or step in (1, settings.steps)
            evaluated = evaluate_fn is not None and (
                (settings.eval_every and step % settings.eval_every == 0)
                or (step == settings.steps and options.evaluate_last)
            )
            saved = step < settings.steps and (
                (settings.checkpoint_every and step % settings.checkpoint_every == 0)
                or (logged and _minutes_passed(accelerator, options.checkpoint_minutes, last_saved))
            )
            if logged or evaluated or saved or step == last_step:
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
                with torch.compiler.set_stance("force_eager") if options.compile_step else contextlib.nullcontext():
                    _evaluate(accelerator, model, evaluate_fn, step, metrics_path, result)
            if saved:
                seconds = earlier + time.perf_counter() - started
                save_checkpoint(accelerator, run_dir, step, micro, settings.keep_last, seconds)
                last_saved = time.perf_counter()
    finally:
        batches.close()
        bar.close()
    result.seconds = time.perf_counter() - started
    result.final_loss = result.losses[-1] if result.losses else float("nan")
    if step >= settings.steps:
        save_checkpoint(accelerator, run_dir, settings.steps, micro, settings.keep_last, earlier + result.seconds)
        save_model(accelerator, model, run_dir / "model")
    return result


def check_minutes(checkpoint_minutes: object) -> None:
    """ValueError unless `checkpoint_minutes` is a number >= 0."""
    if (
        isinstance(checkpoint_minutes, bool)
        or not isinstance(checkpoint_minutes, (int, float))
        or not (checkpoint_minutes >= 0)
    ):
        raise ValueError(f"checkpoint_minutes={checkpoint_minutes!r}: give minutes >= 0 (0: no timed checkpoints)")


def _minutes_passed(accelerator, minutes: float, since: float) -> bool:
    """Whether `minutes` (> 0) have passed since `since` on the main process's clock, the same answer on every
    process (broadcast: they save a checkpoint together or not at all)."""
    if not minutes:
        return False
    passed = [time.perf_counter() - since >= 60 * minutes]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(passed, from_process=0)
    return passed[0]


def _prepare(model, parameters, settings: TrainSettings, accelerator, step_backend: str | None, graphs: bool):
    """The model (gradient checkpointing enabled, its forward compiled with `step_backend` unless None, under CUDA
    graphs when `graphs`), its optimizer and scheduler, prepared by `accelerator`."""
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
    if step_backend is not None:
        compile_for_steps(model, graphs, step_backend)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return model, optimizer, scheduler


def _restore(
    accelerator, run_dir: Path, settings: TrainSettings, checkpoint, resume: bool
) -> tuple[int, int, float, Path]:
    """The step, data position and seconds trained to start from (a checkpoint's state loaded), with the run
    directory's settings.json written and its metrics.jsonl cut back to the start step; and that file's path."""
    start_step, micro, earlier = 0, 0, 0.0
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
        earlier = float(manifest.get("train_seconds", 0.0))
    metrics_path = run_dir / "metrics.jsonl"
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomically(run_dir / "settings.json", settings.to_dict())
        if resume:
            _truncate_metrics(metrics_path, start_step)
        elif metrics_path.exists():
            metrics_path.unlink()
    accelerator.wait_for_everyone()
    return start_step, micro, earlier, metrics_path


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


def _log(accelerator, metrics_path: Path, record: dict[str, Any]) -> None:
    if accelerator.is_main_process:
        with metrics_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
    trackers.log(accelerator, "train", {k: record[k] for k in ("loss", "lr", "tokens_per_s")}, record["step"])


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
