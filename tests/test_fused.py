"""The shared parts through fla's fused kernels ("rotation-fla", "norm-fla", "mlp-fla", "loss-fla") compute the
reference function: the rotary embedding (RoPE's shared tables and xPos's separate q and k tables, at the positions of
left-padded rows), RMSNorm, SwiGLU, and the loss without logits, with transformers' loss semantics (label shift,
ignore_index, num_items_in_batch, shift_labels).

fla's fused linear cross-entropy and rotary embedding run under Triton's CPU interpreter, so CI runs them for real
in a subprocess with TRITON_INTERPRET=1 (the rotary kernel's autotuner cannot time configurations there, so it gets
one), each implementation module's `kernel(x)` (the one place that names fla's function) giving fla's function on the
CPU. Its RMSNorm and SwiGLU kernels do not run there: on the CPU those two parts get plain functions of fla's
signatures, which checks their wiring. Under `pytest --device cuda` every part runs fla's kernels, in bf16."""

import pytest
import torch

from conftest import DEVICE, run_under_triton_interpreter

pytestmark = [pytest.mark.device, pytest.mark.own_process]

pytest.importorskip("fla", reason="fla is not installed (pip install tapelm[gpu])")

CASES = ("labels", "ignored labels", "num_items_in_batch", "shift_labels", "left padding")
PATHS = ("norm-fla", "mlp-fla", "loss-fla", "rotation-fla")


def loss_inputs(case: str, ids: torch.Tensor) -> dict:
    labels = ids.clone()
    if case == "ignored labels":
        labels[:, :4] = -100
    if case == "num_items_in_batch":
        return {"labels": labels, "num_items_in_batch": torch.tensor(50, device=ids.device)}
    if case == "shift_labels":
        return {"labels": labels, "shift_labels": labels.roll(-1, dims=1)}
    if case == "left padding":
        mask = torch.ones_like(ids)
        mask[0, :5] = 0
        labels[0, :5] = -100
        return {"labels": labels, "attention_mask": mask}
    return {"labels": labels}


def compare(device: torch.device, dtype: torch.dtype, tolerance: float, functions=None) -> None:
    """The loss and every gradient of a tiny model with the four paths on against the reference, for every case;
    training with labels returns no logits. `functions`, where given, are what each path's `kernel(x)` gives
    (norm, swiglu, loss, rotary, in fla's signatures), on any device."""
    from tapelm import fast_paths
    from tapelm.kernels.loss import fla as loss
    from tapelm.kernels.mlp import fla as mlp
    from tapelm.kernels.norm import fla as norm
    from tapelm.kernels.rotation import fla as rotation

    modules = (norm, mlp, loss, rotation)
    originals = [module.kernel for module in modules]
    if functions is not None:
        for module, function in zip(modules, functions):
            module.kernel = lambda x, function=function: function
    try:
        with fast_paths.recording() as ran:
            for pe_type in ("rope", "xpos"):
                _compare(device, dtype, tolerance, pe_type)
    finally:
        for module, original in zip(modules, originals):
            module.kernel = original
    assert ran == set(PATHS)


def _compare(device, dtype, tolerance, pe_type):
    from tapelm import TapeConfig, TapeForCausalLM

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (2, 12), generator=generator).to(device)
    for case in CASES:
        results = {}
        for setting in ("off", "on"):
            torch.manual_seed(0)
            config = TapeConfig(
                vocab_size=64,
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                pe_type=pe_type,
                xpos_scale_base=16,
                fast_paths=list(PATHS) if setting == "on" else [],
            )
            model = TapeForCausalLM(config).to(device, dtype).train()
            out = model(ids, **loss_inputs(case, ids))
            out.loss.backward()
            results[setting] = (
                out.loss.detach().double(),
                out.logits,
                {name: p.grad.double() for name, p in model.named_parameters()},
            )
        assert results["on"][1] is None and results["off"][1] is not None
        for name, reference in [("loss", results["off"][0]), *results["off"][2].items()]:
            actual = results["on"][0] if name == "loss" else results["on"][2][name]
            error = (actual - reference).abs().max().item()
            assert error <= tolerance * max(reference.abs().max().item(), 1e-3), (
                f"{pe_type}, {case}, {name}: {error:.3g}"
            )


def plain_rms_norm(x, weight, bias, eps):
    wide = x.float()
    return weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def plain_swiglu(gate, up):
    return torch.nn.functional.silu(gate) * up


def test_fused_parts_compute_the_reference_function():
    if DEVICE.type == "cuda":
        compare(DEVICE, torch.bfloat16, 3e-2)
        return
    script = (
        "import sys, torch; sys.path.insert(0, 'tests'); import test_fused as t; "
        "from fla.modules.rotary import ops, rotary_embedding; "
        "from fla.modules.fused_linear_cross_entropy import fused_linear_cross_entropy_loss as loss; "
        "ops.rotary_embedding_kernel.configs = ops.rotary_embedding_kernel.configs[:1]; "
        "t.compare(torch.device('cpu'), torch.float32, 1e-4, "
        "(t.plain_rms_norm, t.plain_swiglu, loss, rotary_embedding))"
    )
    run_under_triton_interpreter(script)


def test_the_fused_parts_run_in_passes_with_gradients_only():
    """Prefill and decoding take the reference, which was faster there on the H100; nothing runs where fla does
    not."""
    from tapelm.kernels.loss.fla import causal_lm_loss_fla
    from tapelm.kernels.mlp.fla import swiglu_fla
    from tapelm.kernels.norm.fla import rms_norm_fla
    from tapelm.kernels.rotation.fla import rotate_halves_fla

    x = torch.ones(1, 1, 2, 4, device=DEVICE)
    table = torch.ones(1, 1, 2, 2, device=DEVICE)
    calls = {(torch.no_grad, False), (torch.enable_grad, DEVICE.type == "cuda")}
    for context, runs in calls:
        with context():
            results = (
                rms_norm_fla(x, x[0, 0, 0], 1e-6),
                swiglu_fla(x, x),
                rotate_halves_fla(x, table, table),
                causal_lm_loss_fla(x[0], x[0, 0], torch.zeros(1, 2, dtype=torch.long, device=DEVICE)),
            )
        assert all((result is not None) == runs for result in results), (context, results)
