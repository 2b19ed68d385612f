"""What `fast_paths="on"` waited for at its first calls: the autotuned Triton kernels tapelm's fla paths reach (read
from fla 0.6's source), each with the configurations fla lists (every one compiled and timed at a call with a new
tuning key) and the arguments its key reads, and how many tapelm keeps (`tapelm.kernels.AUTOTUNE_CONFIGS`). fla's
FoX and PaTH attention kernels and its fused loss choose their blocks without autotuning; tapelm's own Triton kernels
do not autotune. Runs on the CPU (nothing is compiled): `python docs/gpu/autotune_census.py`."""

import importlib

import tapelm.kernels

REACHED = {
    "mlp-fla": ("fla.modules.activations.ops", ("swiglu_fwd_kernel", "swiglu_fwdbwd_kernel")),
    "norm-fla": (
        "fla.modules.norm.layernorm",
        ("layer_norm_fwd_kernel", "layer_norm_fwd_kernel_row", "layer_norm_bwd_kernel", "layer_norm_bwd_kernel_row"),
    ),
    "rotation-fla": ("fla.modules.rotary.ops", ("rotary_embedding_kernel",)),
    "forgetting-attention-fla": ("fla.ops.utils.cumsum", ("chunk_global_cumsum_scalar_kernel",)),
    "stickbreaking-attention-fla": (
        "fla.ops.stickbreaking_attn.parallel",
        (
            "parallel_stickbreaking_attn_fwd_kernel",
            "parallel_stickbreaking_attn_bwd_kernel_dq",
            "parallel_stickbreaking_attn_bwd_kernel_dkv",
        ),
    ),
}
"""Each fast path's autotuned kernels: fla's module and the kernels' names."""


def main() -> None:
    listed = kept = 0
    for path, (module, kernels) in REACHED.items():
        for name in kernels:
            tuner = getattr(importlib.import_module(module), name)
            tapelm.kernels.bound_fla_autotuning()
            while not hasattr(tuner, "listed_configs"):  # a heuristics wrapper's kernel is the autotuner
                tuner = tuner.fn
            listed, kept = listed + tuner.listed_configs, kept + len(tuner.configs)
            print(f"{path}: {name}: {tuner.listed_configs} configurations, {len(tuner.configs)} kept; key {tuner.keys}")
    print(f"{listed} configurations listed, {kept} kept")


if __name__ == "__main__":
    main()
