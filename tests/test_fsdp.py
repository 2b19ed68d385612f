"""FSDP2 (`torch.distributed.fsdp.fully_shard`) on two CPU processes over gloo, after meta-device initialisation:
build under `torch.device("meta")`, shard every decoder layer and the root, `to_empty`, `init_weights`. The sharded
model starts from the values a normal build gives and, given the same weights, one training step on two half-batches
equals one step of a single process on the whole batch: loss, gradients and the updated weights."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import tiny_config, tiny_model, tokens
from tapelm import PE_TYPES
from test_hf_conventions import deterministic

WORKER = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard
    sys.path.insert(0, sys.argv[2])
    from conftest import tiny_config, tiny_model, tokens
    from tapelm import PE_TYPES, TapeForCausalLM

    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), Path(sys.argv[1])
    results = {}
    for pe in PE_TYPES:
        with torch.device("meta"):
            model = TapeForCausalLM(tiny_config(pe))
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cpu")
        model.init_weights()
        initial = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
        initial |= {name: b.clone() for name, b in model.named_buffers()}
        set_model_state_dict(model, tiny_model(pe).state_dict(), options=StateDictOptions(full_state_dict=True))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ids = tokens(4, 9)[2 * rank: 2 * rank + 2]
        loss = model.eval()(ids, labels=ids, use_cache=False).loss  # eval: RandPE on the given positions
        loss.backward()
        grads = {name: p.grad.full_tensor().clone() for name, p in model.named_parameters()}
        optimizer.step()
        results[pe] = {"initial": initial, "loss": loss.detach(), "grads": grads,
                       "after": {name: p.full_tensor().clone() for name, p in model.named_parameters()}}
    torch.save(results, out / f"rank{rank}.pt")
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp")
    script = out / "worker.py"
    script.write_text(WORKER)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        "29547",
        str(script),
        str(out),
        str(Path(__file__).parent),
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt") for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("pe", PE_TYPES)
def test_sharded_meta_initialisation_gives_a_normal_models_values(ranks, pe):
    expected = deterministic(tiny_config(pe))
    for rank in ranks:
        for name, value in rank[pe]["initial"].items():
            assert torch.isfinite(value).all(), f"{name} was not initialised"
            if name in expected:
                assert torch.equal(value, expected[name]), f"{name} differs from a normally built model's"


@pytest.mark.slow
@pytest.mark.parametrize("pe", PE_TYPES)
def test_a_sharded_step_on_two_half_batches_equals_one_process_on_the_batch(ranks, pe):
    model, ids = tiny_model(pe), tokens(4, 9)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # AdamW would turn rounding noise in ~0 grads into steps
    loss = model(ids, labels=ids, use_cache=False).loss  # both halves have as many label tokens: mean of means
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    optimizer.step()
    torch.testing.assert_close((ranks[0][pe]["loss"] + ranks[1][pe]["loss"]) / 2, loss.detach())
    for rank in ranks:
        for name, p in model.named_parameters():
            torch.testing.assert_close(rank[pe]["grads"][name], grads[name], rtol=1e-4, atol=1e-6, msg=name)
            torch.testing.assert_close(rank[pe]["after"][name], p.detach(), rtol=1e-4, atol=1e-6, msg=name)
