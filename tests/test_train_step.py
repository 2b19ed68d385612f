"""The training step (`training_step`) and how the loop drives it: the same numbers as a plain loop, a non-finite
loss stopping the run at the next read with its step, compiled steps equal to eager ones and reusing their compiled
code across runs, and (on a GPU) no host sync between log steps."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import DEVICE
from tapelm.experiments.runs import RunSpec, batch_stream, resolve
from tapelm.layout import HostLayout
from tapelm.training.checkpoints import list_checkpoints
from tapelm.training.loop import LoopOptions, train
from tapelm.training.schedule import learning_rate_lambda
from tapelm.training.settings import TrainSettings

TINY_MODEL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
QUIET = LoopOptions(progress=False)


def tiny_run(pe: str, **train_options):
    options = {"steps": 6, "batch_size": 8, "warmup": 2, "log_every": 1, "lr": 3e-3, **train_options}
    return resolve(
        RunSpec(task="mqar", pe=pe, model_options=TINY_MODEL, train_options=options, eval_n=4, eval_batch_size=8)
    )


def test_the_loop_computes_what_a_plain_loop_computes(tmp_path) -> None:
    """Losses read at log steps only, token counts on the host copies, foreach AdamW: the same losses, gradient
    norms, token count and final weights as a plain per-step loop, bit for bit, over accumulated micro-batches."""
    run = tiny_run("tape", steps=4, grad_accum=2, clip=0.5, log_every=3)
    settings, stream = run.settings, batch_stream(run.task, 0, run.settings.batch_size)
    trained = run.build_model()
    result = train(trained, stream, settings, tmp_path, options=QUIET)

    model = run.build_model().train()
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": settings.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=settings.lr, betas=settings.betas, foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, learning_rate_lambda(settings))
    losses, norms = [], []
    for step in range(settings.steps):
        total = torch.zeros(())
        for index in range(2 * step, 2 * step + 2):
            loss = model(**stream(index)).loss
            (loss / 2).backward()
            total += loss.detach() / 2
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, settings.clip)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(total.item())

    assert result.losses == losses
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["loss"], m["grad_norm"]) for m in logged] == [
        (step, losses[step - 1], norms[step - 1]) for step in (1, 3, 4)
    ]
    assert result.tokens == sum(int(stream(index)["attention_mask"].sum()) for index in range(8))
    assert all(torch.equal(a, b) for a, b in zip(trained.parameters(), model.parameters(), strict=True))


class _Regression(torch.nn.Module):
    """The squared error of w·x against the batch's targets: a model for the generic loop, whose loss a target of
    infinity makes infinite."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))

    def forward(self, input_ids, targets):
        return SimpleNamespace(loss=((input_ids.float() @ self.weight - targets) ** 2).mean())


@pytest.mark.parametrize("checkpoint_every, stopped_at", [(0, 8), (7, 7)])
def test_a_non_finite_loss_stops_the_run_at_the_next_read_naming_its_step(
    tmp_path, checkpoint_every, stopped_at
) -> None:
    """Step 6's loss is infinite: the run stops at the next log step (8), or the checkpoint before it (7), which is
    then not written, with the step the loss happened at."""

    def stream(index):
        return {
            "input_ids": torch.ones(4, 3, dtype=torch.long),
            "targets": torch.full((4,), float("inf") if index == 5 else 1.0),
        }

    settings = TrainSettings(steps=10, warmup=0, log_every=4, checkpoint_every=checkpoint_every)
    stopped = []
    with pytest.raises(FloatingPointError, match=r"^training loss is inf at step 6; lower the learning rate"):
        train(_Regression(), lambda index: stopped.append(index) or stream(index), settings, tmp_path, options=QUIET)
    assert len(stopped) == stopped_at
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 4]
    assert list_checkpoints(tmp_path) == []


@pytest.mark.device
@pytest.mark.compiles
def test_a_compiled_step_trains_as_the_eager_step_and_the_next_run_reuses_its_code(tmp_path) -> None:
    """compile_step, in bf16 autocast as the GPU presets train: the same losses as eager steps to bf16 rounding; a
    second run of the same shapes (another seed, a new model under accelerate's own autocast wrapper) compiles
    nothing. On CUDA through inductor, under CUDA graphs; on the CPU through AOTAutograd without inductor's code
    generation (whose C++ build of this step took 20-40 s of every suite run: its cache misses in a new checkout)."""
    from torch._dynamo.utils import counters

    def losses(seed, name, compile_step):
        run = resolve(
            RunSpec(
                task="mqar",
                pe="rope",
                seed=seed,
                model_options={**TINY_MODEL, "num_hidden_layers": 1},
                train_options={"steps": 3, "batch_size": 32, "warmup": 1, "log_every": 1, "mixed_precision": "bf16"},
                eval_n=4,
                eval_batch_size=8,
            )
        )
        return train(
            run.build_model(),
            batch_stream(run.task, seed, 32),
            run.settings,
            tmp_path / name,
            options=LoopOptions(
                progress=False,
                compile_step=compile_step,
                compile_backend="inductor" if DEVICE.type == "cuda" else "aot_eager",
            ),
        ).losses

    tolerance = 1e-3 if DEVICE.type == "cpu" else 1e-2  # inductor may round fewer intermediates to bf16
    assert losses(0, "compiled-0", True) == pytest.approx(losses(0, "eager-0", False), rel=tolerance)
    counters.clear()
    assert losses(1, "compiled-1", True) == pytest.approx(losses(1, "eager-1", False), rel=tolerance)
    assert counters["stats"]["unique_graphs"] == 0


@pytest.mark.device
@pytest.mark.compiles  # it switches CUDA's sync debugging itself; no device watching around it
@pytest.mark.parametrize(
    "pe, kind, compile_step",
    [
        ("rope", "plain", False),
        ("rope", "padded", False),
        ("rope", "packed", False),
        ("tape", "padded", False),
        ("tape", "packed", False),
        ("t5", "padded", False),
        ("grape-ap", "padded", False),
        ("rope", "padded", True),
    ],
)
def test_a_step_between_log_steps_makes_no_host_sync(tmp_path, pe, kind, compile_step) -> None:
    """`torch.cuda.set_sync_debug_mode("error")` from the drawing of a step's batches to the next drawing, for every
    step that is not logged: any read from the device raises. The batches are the task's padded ones, the same
    unpadded ("plain") or packing two documents a row ("packed"), each with its host layout, so that the eager model
    reads nothing from the device; a compiled forward traces those reads away."""
    if DEVICE.type != "cuda":
        pytest.skip("host syncs are a CUDA device's: run with pytest --device cuda")
    run = tiny_run(pe, steps=8, log_every=4, mixed_precision="bf16")
    stream = batch_stream(run.task, 0, run.settings.batch_size)

    def watched(index):
        step = index + 1
        torch.cuda.set_sync_debug_mode("default" if step in (1, 4, 8) else "error")
        return reshaped(stream(index), kind)

    try:
        result = train(
            run.build_model(),
            watched,
            run.settings,
            tmp_path,
            options=LoopOptions(progress=False, compile_step=compile_step),
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(result.losses) == 8


def reshaped(batch: dict, kind: str) -> dict:
    """A task's padded batch as it is ("padded"), without its mask ("plain"), or as rows of two documents whose
    positions restart halfway ("packed"), each with its host layout."""
    if kind == "padded":
        return batch
    ids = batch["input_ids"]
    inputs = {"input_ids": ids}
    if kind == "packed":
        half = ids.shape[1] // 2
        inputs["position_ids"] = torch.cat([torch.arange(half), torch.arange(ids.shape[1] - half)])[None]
    return {**inputs, "labels": batch["labels"], "host_layout": HostLayout.of(**inputs)}


def test_the_step_batches_are_host_laid_out() -> None:
    """The batches the no-sync test trains on (on the CPU here): each with a host layout that describes it."""
    batch = batch_stream(tiny_run("rope").task, 0, 8)(0)
    for kind in ("plain", "padded", "packed"):
        made = reshaped(batch, kind)
        host = made["host_layout"]
        assert host.shape == tuple(made["input_ids"].shape)
        assert (host.padded, host.documents) == (kind == "padded", kind == "packed")
