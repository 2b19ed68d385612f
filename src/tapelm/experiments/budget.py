"""What a run costs before it is timed: its training FLOPs and the seconds it is predicted to take on one GPU.

FLOPs are counted as `tapelm bench speed` counts them, on the run's own training batches: 6 per non-embedding
parameter and real token (forward and backward; the model gathers the real tokens of a padded batch before its
projections and MLP), and 6 x layers x hidden x padded width per real token for causal attention. The prediction
divides them by RoPE's measured rate on an H100 and multiplies by the encoding's measured step time against RoPE's;
`tapelm stage` replaces it by the durations of finished runs as soon as there are any.
"""

from __future__ import annotations

import time

import torch

from .runs import ResolvedRun, batch_stream

# RoPE's eager bf16 training step at 12 x 768, 1,024 x 16 tokens on one H100: 80.5 ms, 115 TFLOP/s by the count above
# (docs/gpu/h100-2026-11-26/eager-1k/speed-cuda-paper-1k.json); the nearest measured shape to the short sequences of
# the GPU presets (at 4,096 x 4: 136-148 TFLOP/s).
GPU_FLOPS_PER_SECOND = 115e12
# Step time x RoPE's at the same size: TAPE 1.42 on that H100 and 1.47 on an H200; the others on the H200
# (../shared/gpu/README.md, 45ea02d, "The other encodings"). RandPE rotates like RoPE. At the presets' shorter
# sequences the bias encodings (FIRE, ALiBi) cost less than at 1,024 tokens, so these are upper bounds.
STEP_COST = {"rope": 1.0, "randpe": 1.0, "xpos": 0.99, "nope": 0.77, "alibi": 1.02, "tape": 1.47, "fox": 1.65,
             "fire": 2.36, "cope": 5.81, "t5": 6.86, "path": 7.05}
# Building the model, CUDA's start, the final evaluation, and writing the model and the last checkpoint.
OVERHEAD_SECONDS = 30.0


def non_embedding_parameters(run: ResolvedRun) -> int:
    """The run's parameters less its input and output embeddings."""
    with torch.device("meta"):
        model = run.build_model()
    embeddings = {id(p) for module in (model.get_input_embeddings(), model.get_output_embeddings())
                  for p in module.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in embeddings)


def flops_per_micro_batch(run: ResolvedRun, sample: int = 8) -> float:
    """Training FLOPs of one micro-batch, averaged over the first `sample` micro-batches of seed 0."""
    config, make = run.config, batch_stream(run.task, 0, run.settings.batch_size)
    weights = 6 * non_embedding_parameters(run)
    total = 0.0
    for index in range(sample):
        mask = make(index)["attention_mask"]
        real, width = int(mask.sum()), mask.shape[1]
        total += real * (weights + 6 * config.num_hidden_layers * config.hidden_size * width)
    return total / sample


def training_flops(run: ResolvedRun, sample: int = 8) -> float:
    """Training FLOPs of the whole run."""
    return flops_per_micro_batch(run, sample) * run.settings.steps * run.settings.grad_accum


def batch_seconds(run: ResolvedRun, sample: int = 3) -> float:
    """Seconds this machine takes to make one training micro-batch (the CPU's part of a step)."""
    make = batch_stream(run.task, 0, run.settings.batch_size)
    make(0)
    started = time.perf_counter()
    for index in range(1, sample + 1):
        make(index)
    return (time.perf_counter() - started) / sample


def predicted_seconds(run: ResolvedRun, data_workers: int = 0) -> float:
    """A run's predicted training time on one H100: its FLOPs at RoPE's rate times the encoding's step cost, or the
    time this machine takes to make its batches where that is longer (made alongside the steps by `data_workers`
    processes, or before each step without any). Building the model, evaluating it and saving it add about
    OVERHEAD_SECONDS."""
    compute = training_flops(run) / GPU_FLOPS_PER_SECOND * step_cost(run.spec.pe)
    data = batch_seconds(run) * run.settings.steps * run.settings.grad_accum
    return max(compute, data / data_workers) if data_workers else compute + data


def step_cost(pe: str) -> float:
    """An encoding's measured step time against RoPE's (STEP_COST); the largest of them for one not measured."""
    return STEP_COST.get(pe, max(STEP_COST.values()))


__all__ = ["GPU_FLOPS_PER_SECOND", "OVERHEAD_SECONDS", "STEP_COST", "batch_seconds", "flops_per_micro_batch",
           "non_embedding_parameters", "predicted_seconds", "step_cost", "training_flops"]
