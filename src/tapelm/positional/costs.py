"""Where the encodings' GPU step costs (`StepCost`, declared on each class) come from."""

from __future__ import annotations

from .base import StepCost

GPU_BENCH = (
    "tapelm bench speed on GPUs, step time x RoPE's at 12 x 768, 1,024 x 16 tokens, bf16: TAPE on the default CUDA "
    "paths on an H100 at 7d097c8 (docs/gpu/h100-2026-11-28/speed-1k-auto.json: 99.4 / 73.3 ms); the others on an H200 "
    "at 45ea02d (the GPU measurements' index outside this repository, ../shared/gpu/README.md, \"The other "
    "encodings\"). At the presets' shorter sequences the bias encodings (FIRE, ALiBi) should cost less than at 1,024 "
    "tokens, so these are upper bounds there."
)
FROM_CPU = (
    "Estimated from CPU ratios; not measured on a GPU: the encoding's CPU training-step ratio to RoPE (tapelm bench "
    "speed --sizes small --threads 1 --repeats 2, float32; means whose 95% intervals are wide: 2 cores shared) times "
    "the GPU-over-CPU ratio of a measured encoding that does the same kind of work (its measured cost over its CPU "
    "ratio in docs/speed/speed-cpu-small.json, commit f213807). "
)


def measured(ratio: float) -> StepCost:
    """A cost `tapelm bench speed --device cuda` measured (`GPU_BENCH`)."""
    return StepCost(ratio, True, GPU_BENCH)


def estimated(ratio: float, how: str) -> StepCost:
    """A cost estimated without a GPU; `how` says from what."""
    return StepCost(ratio, False, how)
