"""The fused shared parts (tapelm.kernels.fused) compute the reference function: the rotary embedding (RoPE's
shared tables and xPos's separate q and k tables, at the positions of left-padded rows), RMSNorm, SwiGLU, and the loss
without logits, with transformers' loss semantics (label shift, ignore_index, num_items_in_batch, shift_labels).

fla's fused linear cross-entropy and rotary embedding run under Triton's CPU interpreter, so CI runs them for real
in a subprocess with TRITON_INTERPRET=1 (the rotary kernel's autotuner cannot time configurations there, so it gets
one). Its RMSNorm and SwiGLU kernels do not run there: on the CPU those two parts are routed to plain functions,
which checks their wiring. Under `pytest --device cuda` every part runs fla's kernels, in bf16."""

import pytest
import torch

from conftest import DEVICE, run_under_triton_interpreter

pytestmark = pytest.mark.device

pytest.importorskip("fla", reason="fla is not installed (pip install tapelm[gpu])")

CASES = ("labels", "ignored labels", "num_items_in_batch", "shift_labels", "left padding")
PARTS = ("norm", "swiglu", "loss", "rotary")


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


def compare(device: torch.device, dtype: torch.dtype, tolerance: float, routed) -> None:
    """The loss and every gradient of a tiny model with the fused parts on (through `routed`, a FusedOps) against
    the reference, for every case; training with labels returns no logits."""
    from tapelm.kernels import fused

    calls = []

    def counted(name, op):
        def run(*args):
            calls.append(name)
            return op(*args)
        return run

    original = fused.operations
    fused.operations = lambda tensor: fused.FusedOps(*(counted(name, op) for name, op in zip(PARTS, routed)))
    try:
        for pe_type in ("rope", "xpos"):
            _compare(device, dtype, tolerance, pe_type)
    finally:
        fused.operations = original
    assert set(PARTS) <= set(calls)


def _compare(device, dtype, tolerance, pe_type):
    from tapelm import TapeConfig, TapeForCausalLM

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (2, 12), generator=generator).to(device)
    for case in CASES:
        results = {}
        for setting in ("off", "on"):
            torch.manual_seed(0)
            config = TapeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, pe_type=pe_type,
                                xpos_scale_base=16, fast_paths=setting)
            model = TapeForCausalLM(config).to(device, dtype).train()
            out = model(ids, **loss_inputs(case, ids))
            out.loss.backward()
            results[setting] = (out.loss.detach().double(), out.logits,
                                {name: p.grad.double() for name, p in model.named_parameters()})
        assert results["on"][1] is None and results["off"][1] is not None
        for name, reference in [("loss", results["off"][0]), *results["off"][2].items()]:
            actual = results["on"][0] if name == "loss" else results["on"][2][name]
            error = (actual - reference).abs().max().item()
            assert error <= tolerance * max(reference.abs().max().item(), 1e-3), \
                f"{pe_type}, {case}, {name}: {error:.3g}"


def plain_rms_norm(x, weight, eps):
    wide = x.float()
    return weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def plain_swiglu(gate, up):
    return torch.nn.functional.silu(gate) * up


def test_fused_parts_compute_the_reference_function():
    if DEVICE.type == "cuda":
        from tapelm.kernels import fused

        kernels = fused.operations(torch.empty(0, device=DEVICE, dtype=torch.bfloat16))
        compare(DEVICE, torch.bfloat16, 3e-2, (kernels.rms_norm, kernels.swiglu, kernels.linear_cross_entropy,
                                               kernels.rotary))
        return
    script = ("import sys, torch; sys.path.insert(0, 'tests'); import test_fused as t; "
              "from tapelm.kernels import fused; from fla.modules.rotary import ops; "
              "ops.rotary_embedding_kernel.configs = ops.rotary_embedding_kernel.configs[:1]; "
              "kernels = fused._kernels(); "
              "t.compare(torch.device('cpu'), torch.float32, 1e-4, "
              "(t.plain_rms_norm, t.plain_swiglu, kernels.linear_cross_entropy, kernels.rotary))")
    run_under_triton_interpreter(script)


def test_the_fused_parts_are_off_by_default_and_the_reference_elsewhere():
    from tapelm.kernels import fused

    x = torch.ones(2, device=DEVICE)
    assert fused.fused_operations(x, "auto") is None  # not yet verified on any device
    assert fused.fused_operations(x, "off") is None
    assert (fused.fused_operations(x, "on") is None) == (DEVICE.type != "cuda")


def test_the_fused_parts_run_in_passes_with_gradients_only(monkeypatch):
    """Prefill and decoding take the reference, which was faster there on the H100."""
    from tapelm.kernels import fused

    monkeypatch.setattr(fused, "fla_takes", lambda x: True)  # as on a GPU with fla
    monkeypatch.setattr(fused, "_kernels", lambda: "fla's kernels")
    x = torch.ones(2, device=DEVICE)
    assert fused.fused_operations(x, "on") == "fla's kernels"
    assert fused.fused_operations(x, "off") is None
    with torch.no_grad():
        assert fused.fused_operations(x, "on") is None
