"""Presets: model size, task options, training budget and evaluation size per (preset, task).

`cpu-small` (the default) is a laptop preset: about 0.8M parameters, one torch thread per run, at most about ten
minutes per run (training and evaluation) on one core. The recipes of addition, passkey, MQAR, flip-flop, text and
the word problem were chosen from RoPE's measured learning curves (`tapelm sweep`, docs/sweeps/; docs/RECIPES.md
says how and what each reaches). Addition's is the exception to the ten minutes: at 4,000 steps TAPE failed three
seeds in ten and RoPE one, at 8,000 (15-20 minutes a run, two at a time) both learned on every seed tried, so the
preset trains 8,000 and checkpoints every 500 steps. The other tasks use the preset's "*" entry, a short budget not
chosen from curves. `paper` uses the sizes TAPE.md §7 states (12 layers, hidden 768, 12 heads, TAPE position size
48, 10k steps, lr 1e-4; addition trained up to 40 digits and tested up to 80) and needs GPUs. `gpu` is the
laptop recipes at GPU scale, for `tapelm stage`: each task's laptop model six times wider at its own depth, trained
on its task options with at least 300x its training FLOPs in bf16, evaluated on its test sets (provisional, MQAR's
steps aside: chosen by arithmetic, not yet from learning curves measured on a GPU; docs/RECIPES.md, "GPU scale").
Models this small
gain nothing from intra-op threads, and on a shared 2-core machine two threads measured 7x slower per step (1.84 s
against 0.25 s), so cpu-small runs one thread per run and `--jobs` runs several runs at once instead.

`word_problem` in cpu-small (S3, 8 elements, evaluated at 8..32): at 16 elements RoPE had learned only the first 5
running products after 2,000 steps; at 8 it gets 98.6% of them (91% of whole sequences) right in 2,500 steps at lr
1e-3, about 5 minutes. A5 and S5 are options; with A5 the same recipe learns only the first product (16.6% right,
docs/sweeps/word_problem-A5-T8).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..training.settings import TrainSettings


@dataclass(frozen=True)
class ModelSize:
    """The TapeConfig sizes a preset fixes; everything positional comes from `pe_type` and the task."""

    hidden_size: int = 128
    intermediate_size: int = 344
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    tape_position_size: int | None = None

    def as_config_kwargs(self) -> dict[str, Any]:
        kwargs = dict(vars(self))
        if kwargs["tape_position_size"] is None:
            del kwargs["tape_position_size"]
        return kwargs


@dataclass(frozen=True)
class Preset:
    """One task's recipe within a preset."""

    model: ModelSize
    task_options: dict[str, Any] = field(default_factory=dict)
    train: TrainSettings = field(default_factory=TrainSettings)
    eval_n: int = 100  # examples per condition (text: train_length-token spans of held-out text)
    eval_batch_size: int = 32
    threads: int | None = None  # torch CPU threads when --threads is not given (not part of a run's identity)
    # Compile the training forward for the run's shapes (`compile_for_steps`; not part of a run's identity): off in
    # every preset until a GPU visit measures what it gains against what compiling costs (docs/GPU.md).
    compile_step: bool = False
    # Also checkpoint every that many minutes of training (`RunOptions.checkpoint_minutes`; not part of a run's
    # identity: a resumed run ends as an unbroken one does), so that a run stopped by a visit's deadline or a SLURM
    # preemption resumes from at most that long ago; 0: only the settings' `checkpoint_every`.
    checkpoint_minutes: float = 0.0


_SMALL = ModelSize(
    hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4
)
# Eight 16-dim heads instead of four 32-dim ones (same parameters and FLOPs): with four, RoPE seed 1 and TAPE seed 4
# stalled on whole length cells (22% and 59% exact in distribution); with eight they reach 99.6% and 97.1%
# (docs/sweeps/addition-slow-seeds/). Mean over seeds 0-4: RoPE 97%, TAPE 86% (four heads, on an earlier machine:
# 82% and 79%).
_SMALL_ADDITION = replace(_SMALL, num_attention_heads=8, num_key_value_heads=8)
# Two layers (the induction-head circuit's depth): with four, RoPE stayed at the 34% of queries that elimination
# answers for 4,000 steps (docs/sweeps/mqar/, docs/RECIPES.md).
_SMALL_MQAR = replace(_SMALL, num_hidden_layers=2)
_PAPER = ModelSize(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    tape_position_size=48,
)
# gpu: the laptop model of each task six times wider (the paper's width: 12 heads of 64, MLP 2048) at the laptop's
# depth, on the laptop's task options and test sets, with steps and batch for at least 300x the laptop run's training
# FLOPs (docs/RECIPES.md, "GPU scale": how, and why these are provisional until a GPU measures their learning curves).
_GPU = ModelSize(
    hidden_size=768, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=12
)


def gpu_schedule(steps: int) -> dict[str, int]:
    """The GPU recipes' schedule at `steps`: warm-up for a tenth of the steps up to 200, and a quick in-distribution
    evaluation every eighth of them (each run's learning curve)."""
    return {"steps": steps, "warmup": min(200, steps // 10), "eval_every": max(1, steps // 8)}


def _gpu_train(steps: int, batch_size: int) -> TrainSettings:
    """The GPU recipes' shared training (bf16 autocast, AdamW at lr 5e-4, cosine) at a task's steps and batch."""
    return TrainSettings(
        lr=5e-4, schedule="cosine", batch_size=batch_size, mixed_precision="bf16", log_every=50, **gpu_schedule(steps)
    )


PRESETS: dict[str, dict[str, Preset]] = {
    "cpu-small": {
        "addition": Preset(  # docs/RECIPES.md: lr 2e-3 (3e-3 left TAPE seed 2 at 49%), 8000 steps (at 4000 TAPE
            # failed seeds 1, 4 and 8 of 0-9; docs/sweeps/addition-8000: 10 of 10 runs learn)
            _SMALL_ADDITION,
            {"max_train_digits": 4, "eval_max_digits": 8},
            TrainSettings(
                steps=8000,
                lr=2e-3,
                warmup=100,
                schedule="cosine",
                batch_size=64,
                eval_every=500,
                checkpoint_every=500,
                log_every=50,
            ),
            eval_n=100,
            eval_batch_size=256,
            threads=1,
        ),
        "passkey": Preset(  # docs/sweeps/passkey: RoPE retrieves 97.5% at step 600 and 100% from 1200 at lr 1e-3
            _SMALL,
            {"train_length": 256, "eval_multipliers": (1, 2, 4)},
            TrainSettings(
                steps=1200, lr=1e-3, warmup=100, schedule="cosine", batch_size=8, eval_every=200, log_every=50
            ),
            eval_n=50,
            eval_batch_size=25,
            threads=1,
        ),
        "mqar": Preset(  # docs/sweeps/mqar/mqar-rope-l2: RoPE answers 97% of queries at step 250, 100% from 500
            _SMALL_MQAR,
            {"num_pairs": 8, "num_keys": 64, "num_values": 64, "eval_multipliers": (1, 2, 4)},
            TrainSettings(
                steps=2000, lr=1e-3, warmup=100, schedule="cosine", batch_size=64, eval_every=250, log_every=50
            ),
            eval_n=100,
            eval_batch_size=100,
            threads=1,
        ),
        "flipflop": Preset(  # docs/sweeps/flipflop: RoPE at 99.7-100% of reads from step 400 at lr 1e-3 and 3e-3
            _SMALL,
            {"num_instructions": 64, "p_ignore": 0.8, "eval_multipliers": (1, 2, 4)},
            TrainSettings(
                steps=600, lr=1e-3, warmup=50, schedule="cosine", batch_size=32, eval_every=100, log_every=25
            ),
            eval_n=100,
            eval_batch_size=50,
            threads=1,
        ),
        "text": Preset(  # docs/sweeps/text: RoPE's held-out perplexity 2.75 -> 2.69 over the last 500 of 3000 steps
            _SMALL,
            {"train_length": 64, "eval_multipliers": (1, 2, 4, 8)},
            TrainSettings(
                steps=3000, lr=1e-3, warmup=100, schedule="cosine", batch_size=16, eval_every=250, log_every=50
            ),
            eval_n=128,
            eval_batch_size=32,
            threads=1,
        ),
        "word_problem": Preset(  # docs/sweeps/word_problem-S3-T8: RoPE 98.6% of products, 91% exact in distribution
            _SMALL,
            {"group": "S3", "num_elements": 8, "eval_multipliers": (1, 2, 3, 4)},
            TrainSettings(
                steps=2500, lr=1e-3, warmup=100, schedule="cosine", batch_size=64, eval_every=250, log_every=50
            ),
            eval_n=200,
            eval_batch_size=200,
            threads=1,
        ),
        "*": Preset(
            _SMALL,
            {},
            TrainSettings(steps=400, lr=3e-3, warmup=30, schedule="cosine", batch_size=32, log_every=10),
            eval_n=20,
            eval_batch_size=32,
            threads=1,
        ),
    },
    "paper": {
        "addition": Preset(
            _PAPER,
            {"max_train_digits": 40, "eval_max_digits": 80},
            TrainSettings(
                steps=10000,
                lr=1e-4,
                warmup=500,
                schedule="cosine",
                batch_size=64,
                grad_accum=8,
                mixed_precision="bf16",
                eval_every=1000,
                checkpoint_every=500,
                log_every=20,
            ),
            eval_n=100,
            eval_batch_size=100,
        ),
        "text": Preset(
            _PAPER,
            {"train_length": 1024, "tokenizer": "bpe", "bpe_vocab_size": 32000, "eval_multipliers": (1, 2, 4, 8)},
            TrainSettings(
                steps=10000,
                lr=1e-4,
                warmup=500,
                schedule="cosine",
                batch_size=64,
                grad_accum=8,
                mixed_precision="bf16",
                eval_every=1000,
                checkpoint_every=500,
                log_every=20,
            ),
            eval_n=256,
            eval_batch_size=8,
        ),
        "*": Preset(
            _PAPER,
            {},
            TrainSettings(
                steps=10000,
                lr=1e-4,
                warmup=500,
                schedule="cosine",
                batch_size=64,
                grad_accum=8,
                mixed_precision="bf16",
                eval_every=1000,
                checkpoint_every=500,
                log_every=20,
            ),
            eval_n=100,
            eval_batch_size=16,
        ),
    },
}

DEFAULT_PRESET = "cpu-small"


# A GPU run's checkpoint (0.17-0.35 GB at these sizes: 14-29M parameters, their AdamW moments, in float32) every 3
# minutes of training: a second or so of writing against at most 3 minutes lost to a visit's deadline or a preemption.
GPU_CHECKPOINT_MINUTES = 3.0


def _at_gpu_scale(task: str, model: ModelSize, train: TrainSettings) -> Preset:
    """The laptop recipe of `task` with a GPU model and budget: its task options and evaluation sizes, so that both
    scales are tested on the same test sets."""
    return replace(
        PRESETS[DEFAULT_PRESET][task], model=model, train=train, threads=None, checkpoint_minutes=GPU_CHECKPOINT_MINUTES
    )


# Steps (docs/RECIPES.md, "GPU scale"): MQAR's from the one GPU learning curve measured (RoPE at 99.2% of queries by
# step 1,600 of 3,800 on an H100, 100% from 2,000: 2,400 steps, 1.5x the first), the others at about 300x their laptop
# run's training FLOPs, the least the issue allows, so that every claim's TAPE/RoPE pair fits the GPU time there is.
PRESETS["gpu"] = {
    "mqar": _at_gpu_scale("mqar", replace(_GPU, num_hidden_layers=2), _gpu_train(2400, 1024)),
    "addition": _at_gpu_scale("addition", _GPU, _gpu_train(2150, 2048)),
    "text": _at_gpu_scale("text", _GPU, _gpu_train(850, 512)),
    "passkey": _at_gpu_scale("passkey", _GPU, _gpu_train(750, 128)),
    "*": _at_gpu_scale("*", _GPU, _gpu_train(2000, 256)),
}


def get_preset(name: str, task: str) -> Preset:
    """The recipe of `task` in preset `name` (the preset's default entry for tasks it does not name)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset '{name}'; choose one of: {', '.join(PRESETS)}")
    entries = PRESETS[name]
    return entries.get(task, entries["*"])


def with_train(preset: Preset, **changes: Any) -> Preset:
    """A copy with some training settings changed (validated by TrainSettings)."""
    return replace(preset, train=replace(preset.train, **changes))


__all__ = ["ModelSize", "Preset", "PRESETS", "DEFAULT_PRESET", "get_preset", "gpu_schedule", "with_train"]
