"""Launchers (`tapelm.training.launchers`; a run as their job: `tapelm.experiments.launchers`) and trackers
(`tapelm.training.trackers`): whoever launches a run, and whatever watches it, it trains the same model as one run
alone in this process."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from tapelm.cli import main
from tapelm.experiments.compare import compare, comparison_dir, open_comparison
from tapelm.experiments.launchers import Job
from tapelm.experiments.runs import RESULT_FILE, RunOptions, RunSpec, run_task, settings_hash
from tapelm.training.checkpoints import list_checkpoints
from tapelm.training.launchers import LocalLauncher, SlurmLauncher, device_slots, shared_data_workers
from tapelm.training.trackers import TRACKERS, check_report_to

PES = ["tape", "rope"]
# Long enough (300 steps, a checkpoint every 50) for a job to be killed between its first checkpoint and its end.
BASE = RunSpec(
    task="addition",
    pe="tape",
    task_options={"max_train_digits": 2, "eval_max_digits": 3},
    model_options={
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
    },
    train_options={
        "steps": 300,
        "batch_size": 8,
        "warmup": 1,
        "checkpoint_every": 50,
        "log_every": 10,
        "eval_every": 100,
    },
    eval_n=2,
)


def training(run_dir: Path) -> dict:
    """What a run computed: its evaluation, final loss and every metric line but the timings."""
    result = json.loads((run_dir / RESULT_FILE).read_text())
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timings = ("tokens_per_s", "elapsed_s")
    return {
        "summary": result["summary"],
        "final_loss": result["final_loss"],
        "metrics": [{k: v for k, v in line.items() if k not in timings} for line in lines],
    }


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> Path:
    """The comparison trained one run at a time in this process: what every launcher must reproduce."""
    root = tmp_path_factory.mktemp("local")
    compare(BASE, PES, [0], root=root, progress=False, launcher=LocalLauncher())
    return comparison_dir(root, BASE.task, settings_hash(BASE))


def test_slots_spread_runs_over_every_device_and_share_the_data_workers() -> None:
    assert device_slots(["0", "1"], 2) == ["0", "1", "0", "1"]  # two runs go to two GPUs, not both to the first
    assert device_slots(["cpu"], 3) == ["cpu"] * 3
    assert LocalLauncher(3, devices=["2", "5"]).slots == 6
    assert [shared_data_workers(total, 4) for total in (0, 1, 8, 9)] == [0, 1, 2, 2]


def test_bad_launch_options_get_one_line_errors_before_anything_starts(tmp_path, capsys, monkeypatch) -> None:
    """The library names its arguments (jobs=0), the command its flags (--jobs=0)."""
    root = ["--root", str(tmp_path / "runs")]
    assert main(["compare", "addition", "--slurm-time", "30", *root]) == 2
    assert "--slurm-time is an option of --launcher slurm" in capsys.readouterr().err
    with pytest.raises(ValueError, match="^jobs=0: give a whole number of at least 1"):
        LocalLauncher(0)
    assert main(["compare", "addition", "--jobs", "0", *root]) == 2
    assert "error: --jobs=0: give a whole number of at least 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="^data_workers=-1: give a number of processes >= 0"):
        RunOptions(data_workers=-1)
    with pytest.raises(ValueError, match="^compile_backend='inductr' is not a torch.compile backend: .*'inductor'"):
        RunOptions(compile_backend="inductr")
    assert main(["compare", "addition", "--data-workers", "-1", *root]) == 2
    assert "error: --data-workers=-1: give a number of processes >= 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="distinct device names"):
        LocalLauncher(1, devices=["0", "0"])
    with pytest.raises(ValueError, match="^gpus_per_run=2: give 1"):
        SlurmLauncher(tmp_path, gpus_per_run=2, cluster="local")
    if shutil.which("sbatch") is None:
        assert main(["compare", "addition", "--launcher", "slurm", "--root", str(tmp_path / "runs")]) == 2
        error = capsys.readouterr().err
        assert "error: --launcher slurm submits with SLURM's sbatch, which this machine does not have" in error
    assert main(["compare", "addition", "--launcher", "slurm", "--jobs", "2", "--root", str(tmp_path / "runs")]) == 2
    assert "--jobs is an option of --launcher local" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "submitit", None)  # as where it is not installed
    with pytest.raises(ValueError, match=r"^SlurmLauncher needs the submitit package, which is not installed: pip"):
        SlurmLauncher(tmp_path, cluster="local")
    assert not (tmp_path / "runs").exists()


def test_a_missing_or_unknown_tracker_is_refused_with_the_command_that_installs_it(tmp_path, capsys) -> None:
    import importlib.util

    with pytest.raises(ValueError, match="^report_to='neptune' is not allowed; choose from: tensorboard, wandb"):
        check_report_to(["neptune"])
    assert check_report_to(["none"]) == () and check_report_to(None) == ()
    missing = [name for name, (_, package) in TRACKERS.items() if importlib.util.find_spec(package) is None]
    if not missing:
        pytest.skip("every tracker package is installed here")
    with pytest.raises(
        ValueError,
        match=f"^report_to='{missing[0]}' needs the {TRACKERS[missing[0]][1]} package, "
        f"which is not installed: pip install {TRACKERS[missing[0]][1]}",
    ):
        check_report_to(["tensorboard", missing[0]])
    assert main(["compare", "addition", "--report-to", missing[0], "--root", str(tmp_path / "runs")]) == 2
    error = capsys.readouterr().err
    assert f"error: --report-to='{missing[0]}' needs" in error and "pip install" in error
    assert not (tmp_path / "runs").exists()


def test_a_run_reporting_to_tensorboard_trains_the_same_model_and_logs_its_metric_lines(local, tmp_path) -> None:
    pytest.importorskip("tensorboard", reason="TensorBoard is not installed (pip install tapelm[cluster])")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "watched"
    run_task(
        open_comparison(BASE, PES, [0], tmp_path / "runs").runs["rope", 0],
        run_dir,
        RunOptions(progress=False, report_to=("tensorboard",)),
    )
    assert training(run_dir) == training(local / "rope" / "seed0")
    (events,) = {
        path.parent for path in (run_dir / "tensorboard").rglob("events.out.tfevents.*") if path.parent.name == "tapelm"
    }
    logged = EventAccumulator(str(events))
    logged.Reload()
    lines = [line for line in training(run_dir)["metrics"] if "loss" in line]
    scalars = logged.Scalars("train/loss")
    assert [e.step for e in scalars] == [line["step"] for line in lines]
    assert [e.value for e in scalars] == pytest.approx([line["loss"] for line in lines], rel=1e-6)  # kept as float32
    evaluations = [
        (line["step"], line["eval"]["in_distribution_exact_match"])
        for line in training(run_dir)["metrics"]
        if "eval" in line
    ]
    assert [(e.step, e.value) for e in logged.Scalars("eval/in_distribution_exact_match")] == evaluations


@pytest.mark.slow  # three processes start (about 30 s here)
def test_a_comparison_on_submitit_killed_mid_run_resumes_to_the_local_result(local, tmp_path) -> None:
    """Submitted as one job array through submitit's local executor (the same submission as on SLURM, as processes
    here), one job killed after its first checkpoint; the comparison run again submits only that run, which resumes
    from its checkpoint; every result equals the one trained in this process."""
    pytest.importorskip("submitit", reason="submitit is not installed (pip install tapelm[cluster])")
    import psutil  # accelerate's dependency

    root, lines = tmp_path / "runs", []
    launcher = SlurmLauncher(
        tmp_path / "slurm", time_minutes=10, gpus_per_run=0, cluster="local", poll_seconds=0.2, log=lines.append
    )
    comparison = open_comparison(BASE, PES, [0], root)
    jobs = [Job(comparison.runs[pe, 0], comparison.run_dir(pe, 0), comparison.command) for pe in PES]
    tape, rope = launcher.submit(jobs, RunOptions(progress=False))
    killed = comparison.run_dir("rope", 0)
    deadline = time.time() + 300
    while not list_checkpoints(killed) and time.time() < deadline:
        time.sleep(0.02)
    # killed as a failing node kills it: the job's process, a child of submitit's local controller (whose pid is the
    # job id). Not `cancel`: it sends SIGINT, which a suite started in the background (as CI may start it) ignores.
    for process in psutil.Process(int(rope.job_id)).children():
        process.kill()
    assert tape.result()["pe"] == "tape"
    while not rope.done() and time.time() < deadline:
        time.sleep(0.1)
    assert list_checkpoints(killed) and not (killed / RESULT_FILE).exists()  # killed mid-run, its checkpoint kept
    lines.clear()
    compare(BASE, PES, [0], root=root, progress=False, launcher=launcher)
    assert sum("submitted " in line for line in lines) == 1  # the finished run is not submitted again
    resumed = json.loads((killed / RESULT_FILE).read_text())
    whole = json.loads((local / "rope" / "seed0" / RESULT_FILE).read_text())
    assert 0 < resumed["tokens_this_session"] < whole["tokens_this_session"]  # it went on from its checkpoint
    assert resumed["launch"]["launcher"] == "slurm" and resumed["launch"]["job_id"] != rope.job_id
    for pe in PES:
        assert training(comparison.run_dir(pe, 0)) == training(local / pe / "seed0")


@pytest.mark.slow  # a submitit job that starts twice (about 50 s here)
def test_a_preempted_job_requeues_through_submitit_and_resumes_to_the_local_result(local, tmp_path) -> None:
    """submitit's preemption signal (USR2, what SLURM sends a job it preempts) reaches the training job after its
    first timed checkpoint: submitit's handler calls the job's `checkpoint`, requeues it (its local executor starts
    the job again), the requeued job resumes from the checkpoint, and its result equals the one trained unbroken in
    this process. The signal goes to the job's process itself: `LocalJob._interrupt` sends it to submitit's local
    controller, which does not pass it on."""
    pytest.importorskip("submitit", reason="submitit is not installed (pip install tapelm[cluster])")
    import psutil  # accelerate's dependency
    from submitit.local.local import LocalJobEnvironment

    launcher = SlurmLauncher(tmp_path / "slurm", time_minutes=30, gpus_per_run=0, cluster="local", poll_seconds=0.2)
    comparison = open_comparison(BASE, ["rope"], [0], tmp_path / "runs")
    run_dir = comparison.run_dir("rope", 0)
    job = Job(comparison.runs["rope", 0], run_dir, comparison.command)
    (handle,) = launcher.submit([job], RunOptions(progress=False, checkpoint_minutes=1e-9))  # every log step
    deadline = time.time() + 300
    while not list_checkpoints(run_dir) and time.time() < deadline:
        time.sleep(0.02)
    assert not (run_dir / RESULT_FILE).exists()
    (task,) = psutil.Process(handle._process.pid).children()  # the job, under submitit's local controller
    task.send_signal(LocalJobEnvironment._usr_sig())
    result = handle.result()
    log = handle.stdout() or ""
    assert "this job is preempted" in log and "Calling checkpoint method" in log and "Requeued job" in log
    assert 0 < result["resumed_from_step"] < BASE.train_options["steps"]
    whole = json.loads((local / "rope" / "seed0" / RESULT_FILE).read_text())
    assert 0 < result["tokens_this_session"] < whole["tokens_this_session"]  # it went on from its checkpoint
    assert training(run_dir) == training(local / "rope" / "seed0")


@pytest.mark.device
def test_on_cuda_every_visible_gpu_trains_runs_pinned_to_it(tmp_path) -> None:
    """`pytest --device cuda`: two runs at once per visible GPU, each in a worker that sees only its GPU; every GPU
    gets runs, each result names the GPU it ran on, and a run's first loss (the initial model, the same batch) is
    the in-process one's."""
    import torch

    import conftest
    from tapelm.training.launchers import visible_devices

    if conftest.DEVICE.type != "cuda":
        pytest.skip("needs CUDA: run with --device cuda")
    devices = visible_devices()
    short = RunSpec(**{**vars(BASE), "train_options": {**BASE.train_options, "steps": 20, "checkpoint_every": 0}})
    seeds = list(range(len(devices) * 2))
    compare(short, ["rope"], seeds, root=tmp_path / "pinned", progress=False, launcher=LocalLauncher(2))
    compare(
        short, ["rope"], [0], root=tmp_path / "alone", progress=False, launcher=LocalLauncher(1, devices=devices[:1])
    )
    pinned = comparison_dir(tmp_path / "pinned", short.task, settings_hash(short))
    records = [json.loads((pinned / "rope" / f"seed{seed}" / RESULT_FILE).read_text()) for seed in seeds]
    assert sorted(r["device"]["cuda_visible_devices"] for r in records) == sorted(devices * 2)
    for record in records:
        assert record["device"]["device"].startswith("cuda") and record["launch"]["runs_per_device"] == 2
        assert record["device"]["name"] == torch.cuda.get_device_name(devices.index(record["launch"]["device_slot"]))
    alone = json.loads(
        (
            comparison_dir(tmp_path / "alone", short.task, settings_hash(short)) / "rope" / "seed0" / RESULT_FILE
        ).read_text()
    )
    assert records[0]["first_loss"] == pytest.approx(alone["first_loss"], rel=1e-5)
