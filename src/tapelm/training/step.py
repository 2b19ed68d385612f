"""One optimizer update and what feeds it: the optimizer, the micro-batches (made ahead in workers when asked), the
loss read back from the device, the compiled forward."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping

import torch

from .settings import TrainSettings

BatchStream = Callable[[int], Mapping[str, torch.Tensor]]


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


def token_count(batch: Mapping[str, torch.Tensor]) -> torch.Tensor | int:
    """The real tokens of a micro-batch, counted where the batch is (its host copy: no device read)."""
    mask = batch.get("attention_mask")
    return mask.sum() if mask is not None else batch["input_ids"].numel()


def compile_for_steps(model: torch.nn.Module, graphs: bool, backend: str = "inductor") -> None:
    """torch.compile the model's forward (with its loss, hence its backward) with `backend` for the shapes it is
    called with, with inductor's CUDA graphs when `graphs` (mode "reduce-overhead"): a step then launches a few
    graphs instead of hundreds of kernels. `train` asks for graphs on CUDA with inductor and without gradient
    accumulation only: with it, a micro-batch's gradients might live in memory that the next micro-batch's graph
    rewrites (not tried on a GPU). Shapes are static until one changes (then one dynamic recompilation, not one per
    length). The forward is compiled before accelerate wraps it in autocast, and compiled code is keyed by code and
    shapes, not by the model object, so another model of the same configuration trained in this process reuses it:
    the compiler's caches are not reset, and dynamo may keep 64 versions of the forward instead of 8 (past them it
    would run eagerly), so that a process training several configurations keeps each."""
    torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)
    if graphs:
        model.forward = torch.compile(model.forward, mode="reduce-overhead")
    else:
        model.forward = torch.compile(model.forward, backend=backend)


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
