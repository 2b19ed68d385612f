"""Fine-tuning on one SCROLLS task through tapelm's training loop (`tapelm.training.loop.train`: accelerate,
atomic checkpoints, exact resume), from any source `tapelm.scrolls.models.load_source` accepts.

Presets:

- `paper`: the paper's recipe for GPUs: context 8,192 tokens, 64 sequences per update (micro-batch 1 x 64
  accumulation steps on one process; under `accelerate launch` with N processes pass --grad-accum 64/N), AdamW lr
  1e-5, 1,000 steps, 10% (100 steps) linear warm-up then polynomial (linear) decay to 0, no weight decay, clip 1.0,
  bf16, activation checkpointing, a checkpoint every 100 steps.
- `cpu-small`: a laptop recipe sized for the laptop end-to-end run (context 4x the source's pretraining length,
  target caps at most a quarter of the context, so that a QA document keeps most of the prompt).

A run directory holds, besides what `train` writes: scrolls.json (source, task, data, context, caps, tokenizer,
settings; a resume with other ones is refused) and, after `tapelm scrolls predict`, predictions and scores.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..data.examples import collate
from ..data.tokenization import save_tokenizer
from ..training.accelerator import make_accelerator
from ..training.atomic import write_json_atomically
from ..training.checkpoints import CheckpointError, check_run_dir
from ..training.loop import LoopOptions, train
from ..training.settings import TrainSettings
from .data import load_rows
from .models import SCROLLS_RUN_FILE, load_source
from .prompting import TARGET_CAPS, PromptSettings, check_document_room, training_example
from .tasks import get_task

logger = logging.getLogger(__name__)

PRESETS: dict[str, dict[str, Any]] = {
    "paper": {
        "context": 8192,
        "train": TrainSettings(
            steps=1000,
            lr=1e-5,
            warmup=100,
            schedule="polynomial",
            min_lr_ratio=0.0,
            weight_decay=0.0,
            batch_size=1,
            grad_accum=64,
            clip=1.0,
            mixed_precision="bf16",
            grad_checkpointing=True,
            checkpoint_every=100,
            keep_last=2,
            log_every=10,
        ),
    },
    "cpu-small": {
        "context_multiplier": 4,
        "target_cap_share": 0.25,
        "train": TrainSettings(
            steps=150,
            lr=1e-3,
            warmup=15,
            schedule="polynomial",
            min_lr_ratio=0.0,
            weight_decay=0.0,
            batch_size=8,
            grad_accum=1,
            clip=1.0,
            checkpoint_every=50,
            keep_last=1,
            log_every=10,
        ),
    },
}


@dataclass(frozen=True)
class FinetuneSpec:
    """What one fine-tuning run is: source, task, data, context (None: the preset's), caps, PI and training."""

    source: str
    task: str
    data: str | None = None
    preset: str = "cpu-small"
    context: int | None = None
    target_cap: int | None = None
    position_interpolation: bool = False
    pretrained_length: int | None = None
    pe: str | None = None  # the encoding a Llama-family source is converted to (None: tape)
    train_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    limit: int | None = None  # at most this many training ids (a quick run)

    def settings(self) -> TrainSettings:
        preset = get_preset(self.preset)
        return TrainSettings.from_dict({**preset["train"].to_dict(), **self.train_options, "seed": self.seed})


def get_preset(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is not allowed; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]


def resolve_context(spec: FinetuneSpec, pretrained_length: int) -> int:
    if spec.context is not None:
        return spec.context
    preset = get_preset(spec.preset)
    return preset.get("context") or preset["context_multiplier"] * pretrained_length


def resolve_target_cap(spec: FinetuneSpec, task, context: int) -> int:
    """--target-cap, else the task kind's cap (TARGET_CAPS), at most the preset's share of the context."""
    if spec.target_cap is not None:
        return spec.target_cap
    share = get_preset(spec.preset).get("target_cap_share")
    return min(TARGET_CAPS[task.kind], int(share * context)) if share else TARGET_CAPS[task.kind]


def check_spec(spec: FinetuneSpec) -> None:
    """Validate what can be validated before loading anything."""
    get_task(spec.task)
    get_preset(spec.preset)
    spec.settings()
    for name in ("context", "target_cap", "pretrained_length", "limit"):
        value = getattr(spec, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name}={value!r} is not allowed; it must be a positive integer")


class TokenizedRows:
    """The training examples of `rows`, each tokenized when a batch asks for it, so that memory holds the text only
    (a GovReport training split is about 17k documents of up to ~10k tokens)."""

    def __init__(self, task, codec, rows, prompts: PromptSettings) -> None:
        self.task, self.codec, self.rows, self.prompts = task, codec, rows, prompts

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int):
        row = self.rows[index]
        return training_example(self.task, self.codec, row.input, row.output, self.prompts)


class TrainingStream:
    """index -> one micro-batch: a pure function of (seed, index). Rows are visited in a fresh seeded order each
    epoch; micro-batch `index` takes rows index * batch_size ... of that endless sequence."""

    def __init__(self, examples, pad_id: int, batch_size: int, seed: int) -> None:
        self.examples, self.pad_id, self.batch_size, self.seed = examples, pad_id, batch_size, seed
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) > 2:
                self._orders.clear()
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))
        return self._orders[epoch]

    def __call__(self, index: int) -> dict[str, torch.Tensor]:
        count = len(self.examples)
        chosen = []
        for position in range(index * self.batch_size, (index + 1) * self.batch_size):
            epoch, offset = divmod(position, count)
            chosen.append(self.examples[int(self._order(epoch)[offset])])
        batch = collate(chosen, self.pad_id)
        return {"input_ids": batch.input_ids, "labels": batch.labels, "attention_mask": batch.attention_mask}


def _identity(spec: FinetuneSpec, context: int, target_cap: int, source) -> dict[str, Any]:
    return {
        "source": str(spec.source),
        "task": spec.task,
        "data": None if spec.data is None else str(spec.data),
        "preset": spec.preset,
        "context": context,
        "target_cap": target_cap,
        "position_interpolation": spec.position_interpolation,
        "pretrained_length": source.pretrained_length,
        "pe": source.model.config.pe_type,
        "limit": spec.limit,
        "train": spec.settings().to_dict(),
    }


def finetune(
    spec: FinetuneSpec, run_dir: str | Path, resume: bool = False, progress: bool = True, stop_after: int | None = None
) -> dict[str, Any]:
    """Fine-tune `spec.source` on `spec.task`'s training rows; returns the run record (also scrolls.json)."""
    check_spec(spec)
    run_dir = Path(run_dir)
    settings = spec.settings()
    task = get_task(spec.task)
    check_run_dir(run_dir, settings, resume)  # refuses a foreign or unfinished-without-resume folder, writes nothing
    rows = [row for row in load_rows(spec.task, "train", spec.data, spec.limit) if row.output]
    if not rows:
        raise ValueError(f"the training split of '{spec.task}' has no row with an output")
    source = load_source(spec.source, spec.context, False, spec.pretrained_length, spec.pe)
    context = resolve_context(spec, source.pretrained_length)
    prompts = PromptSettings(context, resolve_target_cap(spec, task, context))
    prompts.check(task, source.codec)
    sample = np.random.default_rng(spec.seed).permutation(len(rows))[:256]
    dropped = check_document_room(task, source.codec, [rows[int(i)].input for i in sample], prompts)
    if dropped:
        logger.warning(
            "tapelm: %d of %d sampled training rows keep no document token at context=%d with "
            "target_cap=%d; raise --context or lower --target-cap",
            dropped,
            len(sample),
            context,
            prompts.target_cap,
        )
    if spec.position_interpolation:  # rebuilt with the interpolation factor context / pretraining length
        source = load_source(spec.source, context, True, spec.pretrained_length, spec.pe)
    identity = _identity(spec, context, prompts.target_cap, source)
    record_path = run_dir / SCROLLS_RUN_FILE
    if record_path.exists():
        saved = json.loads(record_path.read_text())
        if saved.get("identity") != identity:
            changed = sorted(
                k
                for k in set(saved.get("identity", {})) | set(identity)
                if saved.get("identity", {}).get(k) != identity.get(k)
            )
            raise CheckpointError(
                f"run directory '{run_dir}' belongs to another fine-tuning (different "
                f"{', '.join(changed)}); choose another run directory"
            )
        if resume and saved.get("finished"):
            return saved
    examples = TokenizedRows(task, source.codec, rows, prompts)
    record = {
        "identity": identity,
        "settings_hash": hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:10],
        "tokenizer": source.tokenizer,
        "pretrained_length": source.pretrained_length,
        "context": context,
        "target_cap": prompts.cap(task),
        "task": spec.task,
        "training_rows": len(examples),
        "source_description": source.description,
        "mean_training_tokens_of_256_rows": float(np.mean([len(examples[int(i)].ids) for i in sample])),
    }
    # The Accelerator comes first (see tapelm.experiments.runs.run_task); only the main process writes.
    accelerator = make_accelerator(settings)
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomically(record_path, record)
    accelerator.wait_for_everyone()
    torch.manual_seed(spec.seed)
    stream = TrainingStream(examples, source.codec.pad_id, settings.batch_size, spec.seed)
    result = train(
        source.model,
        stream,
        settings,
        run_dir,
        resume=resume,
        accelerator=accelerator,
        options=LoopOptions(progress=progress, stop_after=stop_after),
    )
    done = result.start_step + len(result.losses) >= settings.steps
    if accelerator.is_main_process:
        if done and source.hf_tokenizer is not None:
            source.hf_tokenizer.save_pretrained(str(run_dir / "model"))
        elif done:  # a tapelm text run's own tokenizer: the fine-tuned model carries it from now on
            save_tokenizer(source.codec.tokenizer, run_dir / "model")
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        losses = [m["loss"] for m in metrics if "loss" in m]
        record.update(
            finished=done,
            first_loss=losses[0] if losses else None,
            final_loss=losses[-1] if losses else None,
            train_seconds_this_session=result.seconds,
            tokens_this_session=result.tokens,
        )
        write_json_atomically(record_path, record)
    accelerator.wait_for_everyone()
    return record


__all__ = [
    "FinetuneSpec",
    "PRESETS",
    "finetune",
    "TrainingStream",
    "TokenizedRows",
    "get_preset",
    "check_spec",
    "resolve_context",
]
