"""Two CPU processes under `accelerate launch --multi_gpu` (DDP over gloo): the world size is really 2, the ranks
draw different batches, and the parameters stay identical across ranks after training."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

WORKER = textwrap.dedent("""
    import hashlib, json, sys
    from pathlib import Path
    import torch
    from accelerate import PartialState
    from tapelm.experiments.runs import RunSpec, batch_stream, resolve
    from tapelm.training.loop import LoopOptions, train

    out = Path(sys.argv[1])
    run = resolve(RunSpec(task="addition", pe="tape", task_options={"max_train_digits": 3, "eval_max_digits": 4},
                          model_options={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                         "num_attention_heads": 4, "num_key_value_heads": 2},
                          train_options={"steps": 4, "batch_size": 4, "warmup": 1, "log_every": 1, "lr": 1e-2,
                                         "checkpoint_every": 2}))
    model = run.build_model()
    initial = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    stream = batch_stream(run.task, 0, 4)
    asked, firsts = [], []
    def recording(index):
        batch = stream(index)
        asked.append(index)
        firsts.append(hashlib.sha256(batch["input_ids"].numpy().tobytes()).hexdigest())
        return batch
    result = train(model, recording, run.settings, out / "run", options=LoopOptions(progress=False))
    state = PartialState()
    final = torch.cat([p.detach().flatten() for p in model.parameters()])
    (out / f"rank{state.process_index}.json").write_text(json.dumps({
        "rank": state.process_index, "world": state.num_processes, "distributed_type": str(state.distributed_type),
        "asked": asked, "batches": firsts, "params": final.tolist(), "moved": float((final - initial).abs().max()),
        "losses": result.losses}))
    # The task path (`tapelm train`) in the same processes: one run, evaluated once, recorded as world size 2.
    from tapelm.experiments.runs import RunOptions, run_task
    cli = run_task(run, out / "task-run", RunOptions(progress=False))
    (out / f"task{state.process_index}.json").write_text(json.dumps(cli and {"world": cli["world_size"]}))
""")


def _launcher() -> list[str] | None:
    accelerate = Path(sys.executable).with_name("accelerate")
    if accelerate.exists():
        return [
            str(accelerate),
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            "29533",
        ]
    torchrun = shutil.which("torchrun")
    return [torchrun, "--nproc_per_node", "2"] if torchrun else None


@pytest.mark.slow
def test_two_cpu_processes_train_in_sync(tmp_path) -> None:
    launcher = _launcher()
    if launcher is None:
        pytest.skip("neither accelerate nor torchrun is installed next to this Python")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launcher, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    assert all("MULTI_CPU" in r["distributed_type"] for r in ranks)
    assert ranks[0]["asked"] == [0, 2, 4, 6] and ranks[1]["asked"] == [1, 3, 5, 7]
    assert not set(ranks[0]["batches"]) & set(ranks[1]["batches"])  # each rank saw different data
    assert ranks[0]["moved"] > 1e-3  # training changed the weights ...
    assert ranks[0]["params"] == ranks[1]["params"]  # ... identically on both ranks (gradients all-reduced)
    assert ranks[0]["losses"] == ranks[1]["losses"]  # the logged loss is the mean over ranks
    assert json.loads((tmp_path / "task0.json").read_text()) == {"world": 2}
    assert json.loads((tmp_path / "task1.json").read_text()) is None  # only the main process evaluates
    manifest = json.loads(next((tmp_path / "run" / "checkpoints").glob("step-*/manifest.json")).read_text())
    assert manifest["world_size"] == 2
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(manifest["files"])


SCROLLS_WORKER = textwrap.dedent("""
    import sys
    from datetime import timedelta
    from accelerate import PartialState
    PartialState(cpu=True, timeout=timedelta(seconds=float(sys.argv[1])))  # a short collective timeout everywhere
    from tapelm.cli import main
    sys.exit(main(["scrolls", "run", "qasper", *sys.argv[2:]]))
""")


@pytest.mark.slow
def test_two_processes_run_scrolls_with_generation_longer_than_the_collective_timeout(tmp_path) -> None:
    """`scrolls run` under a launcher: the ranks fine-tune together, then no rank waits on a collective while the
    main process generates, so a generation longer than the process group's timeout does not kill the run."""
    from tapelm.experiments.runs import RunOptions, RunSpec, run_task

    launcher = _launcher()
    if launcher is None:
        pytest.skip("neither accelerate nor torchrun is installed next to this Python")
    launcher = [a if a != "29533" else "29534" for a in launcher]
    corpus = tmp_path / "corpus.py"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 40)
    run_task(
        RunSpec(
            task="text",
            pe="tape",
            task_options={"corpus": str(corpus), "train_length": 16, "eval_multipliers": (1, 2)},
            model_options={
                "hidden_size": 32,
                "intermediate_size": 48,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
            },
            train_options={"steps": 1, "batch_size": 2, "warmup": 0},
            eval_n=4,
            eval_batch_size=4,
        ),
        tmp_path / "text-run",
        RunOptions(progress=False),
    )
    data = tmp_path / "data"
    data.mkdir()
    for split, count in (("train", 8), ("validation", 80)):
        rows = [
            {"id": f"{split}{i}", "input": f"What is {i}?\n\n{i} is a number.", "output": f"number {i}"}
            for i in range(count)
        ]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    script = tmp_path / "worker.py"
    script.write_text(SCROLLS_WORKER)
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "runs"
    done = subprocess.run(
        [
            *launcher,
            str(script),
            "3",
            "--model",
            str(tmp_path / "text-run"),
            "--data",
            str(data),
            "--out",
            str(out),
            "--target-cap",
            "10",
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--warmup",
            "0",
            "--max-new-tokens",
            "40",
            "--predict-batch-size",
            "1",
            "--no-progress",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((out / "qasper" / "scrolls.json").read_text())["finished"]
    assert len(json.loads((out / "qasper" / "predictions-validation.json").read_text())) == 80
    assert json.loads((out / "qasper" / "scores-validation.json").read_text())["num_predicted"] == 80
