"""The training loop: schedules, a smoke run whose loss falls, exact resume, atomic checkpoints, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tapelm.cli import build_parser, main
from tapelm.experiments.commands import spec_from_args
from tapelm.experiments.runs import RunOptions, RunSpec, batch_stream, resolve, run_task
from tapelm.training.checkpoints import CheckpointError, latest_checkpoint, list_checkpoints, verify_checkpoint
from tapelm.training.loop import LoopOptions, train
from tapelm.training.schedule import learning_rate_lambda
from tapelm.training.settings import TrainSettings
from tapelm.training.step import micro_batches

TINY_MODEL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
TINY_TASK = {"max_train_digits": 3, "eval_max_digits": 4}
QUIET = LoopOptions(progress=False)


def tiny_spec(pe: str = "tape", seed: int = 0, **train_options) -> RunSpec:
    options = {"steps": 8, "batch_size": 8, "warmup": 2, "log_every": 1, "lr": 3e-3, **train_options}
    return RunSpec(
        task="addition",
        pe=pe,
        seed=seed,
        task_options=TINY_TASK,
        model_options=TINY_MODEL,
        train_options=options,
        eval_n=4,
        eval_batch_size=64,
    )


def tiny_cli(out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--task",
        "addition",
        "--pe",
        "rope",
        "--out",
        str(out),
        "--steps",
        "4",
        "--batch-size",
        "4",
        "--warmup",
        "1",
        "--eval-n",
        "2",
        "--log-every",
        "1",
        "--no-progress",
        *(f"--task-option={k}={v}" for k, v in TINY_TASK.items()),
        *(f"--model-option={k}={v}" for k, v in TINY_MODEL.items()),
        *extra,
    ]


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_settings_reject_bad_values_naming_the_field() -> None:
    with pytest.raises(ValueError, match="schedule='linear'.*constant, cosine"):
        TrainSettings(schedule="linear")
    with pytest.raises(ValueError, match="mixed_precision='fp8'"):
        TrainSettings(mixed_precision="fp8")
    with pytest.raises(ValueError, match="steps=0"):
        TrainSettings(steps=0)
    with pytest.raises(ValueError, match="unknown training setting 'epochs'"):
        TrainSettings.from_dict({"epochs": 3})


def test_warmup_then_cosine_or_constant() -> None:
    cosine = learning_rate_lambda(TrainSettings(steps=100, warmup=10, schedule="cosine", min_lr_ratio=0.1))
    constant = learning_rate_lambda(TrainSettings(steps=100, warmup=10, schedule="constant"))
    warm = [cosine(s) for s in range(10)]
    assert warm == sorted(warm) and warm[0] < 0.2 and warm[-1] < 1
    assert cosine(10) == pytest.approx(1.0)
    assert cosine(55) == pytest.approx(0.55)
    assert cosine(100) == pytest.approx(0.1)
    decay = [cosine(s) for s in range(10, 101)]
    assert decay == sorted(decay, reverse=True)
    assert all(constant(s) == 1.0 for s in range(10, 100))


def test_wsd_is_constant_then_a_cosine_over_the_last_fifth() -> None:
    wsd = learning_rate_lambda(TrainSettings(steps=100, warmup=10, schedule="wsd", min_lr_ratio=0.1))
    assert all(wsd(s) == 1.0 for s in range(10, 81))
    assert wsd(90) == pytest.approx(0.55)
    assert wsd(100) == pytest.approx(0.1)
    decay = [wsd(s) for s in range(80, 101)]
    assert decay == sorted(decay, reverse=True)


def test_smoke_training_loss_falls(tmp_path) -> None:
    run = resolve(tiny_spec(steps=60, batch_size=16))
    result = run_task(run, tmp_path / "run", RunOptions(progress=False))
    losses = [
        json.loads(line)["loss"]
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if "loss" in line
    ]
    assert len(losses) == 60
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:5]) / 5
    assert result["final_loss"] == losses[-1]
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()
    evaluation = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert len(evaluation["conditions"]) == 16 and (tmp_path / "run" / "eval.png").stat().st_size > 1000


def test_compiled_layers_train_the_same_function_as_eager_layers(tmp_path) -> None:
    """--compile: the decoder layers really run through torch.compile while training, the losses follow eager
    training to float rounding, and the run finishes with its (eager) evaluation. Through dynamo's own backend: the
    graph capture that every backend starts from (test_fast_paths.py traces the layers' backward through AOTAutograd,
    test_train_step.py a whole step)."""
    from torch._dynamo.utils import counters

    spec = tiny_spec("tape", steps=4, eval_every=2)
    eager_result = run_task(resolve(spec), tmp_path / "eager", RunOptions(progress=False))
    counters.clear()
    options = RunOptions(progress=False, compile_layers=True, compile_backend="eager")
    compiled_result = run_task(resolve(spec), tmp_path / "compiled", options)
    assert counters["stats"]["unique_graphs"] > 0
    losses = {
        name: [
            json.loads(line)["loss"]
            for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line
        ]
        for name in ("eager", "compiled")
    }
    assert len(losses["compiled"]) == 4
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4)
    assert compiled_result["compiled_layers"] == "eager" and eager_result["compiled_layers"] is False
    commands = {name: json.loads((tmp_path / name / "run.json").read_text())["command"] for name in losses}
    assert commands["compiled"] == commands["eager"] + " --compile"
    assert compiled_result["summary"].keys() == eager_result["summary"].keys()


@pytest.mark.parametrize("pe", ["randpe", "tape"])
def test_resume_reproduces_the_uninterrupted_losses(tmp_path, pe) -> None:
    """RandPE draws its positions from torch's RNG while training: equality needs the RNG state restored too."""
    settings = dict(steps=9, checkpoint_every=3, keep_last=2, grad_accum=2)
    run = resolve(tiny_spec(pe, **settings))

    def fresh(directory, resume=False, stop_after=None):
        return train(
            run.build_model(),
            batch_stream(run.task, 0, run.settings.batch_size),
            run.settings,
            directory,
            resume=resume,
            options=LoopOptions(progress=False, stop_after=stop_after),
        )

    whole = fresh(tmp_path / "whole")
    first = fresh(tmp_path / "cut", stop_after=5)  # "killed" after step 5: the last checkpoint is step 3
    assert first.losses == whole.losses[:5]
    assert [step for step, _ in list_checkpoints(tmp_path / "cut")] == [3]
    resumed = fresh(tmp_path / "cut", resume=True)
    assert resumed.start_step == 3
    assert resumed.losses == whole.losses[3:]
    for name in ("model.safetensors",):
        assert (tmp_path / "cut" / "model" / name).read_bytes() == (tmp_path / "whole" / "model" / name).read_bytes()
    logged = [json.loads(line)["step"] for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, 10))  # lines logged after the checkpoint were dropped, none repeated
    assert [step for step, _ in list_checkpoints(tmp_path / "cut")] == [6, 9]  # keep_last=2


def test_each_checkpoint_is_complete_and_a_partial_one_is_never_picked(tmp_path) -> None:
    run = resolve(tiny_spec(steps=4, checkpoint_every=2, keep_last=3))
    train(run.build_model(), batch_stream(run.task, 0, 8), run.settings, tmp_path, options=QUIET)
    step, path = latest_checkpoint(tmp_path)
    assert step == 4
    manifest = verify_checkpoint(path)
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"} <= set(manifest["files"])
    assert manifest["data_position"] == 4
    # A write interrupted before its rename leaves a temporary folder: never a candidate.
    partial = tmp_path / "checkpoints" / ".step-00000006.tmp"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    assert latest_checkpoint(tmp_path)[0] == 4
    # A finished-looking folder without its manifest, or with a damaged file, is refused by name.
    (partial).rename(tmp_path / "checkpoints" / "step-00000006")
    with pytest.raises(CheckpointError, match="step-00000006' is incomplete: it has no manifest.json"):
        latest_checkpoint(tmp_path)
    (tmp_path / "checkpoints" / "step-00000006" / "model.safetensors").unlink()
    (tmp_path / "checkpoints" / "step-00000006").rmdir()
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="step-00000004' is corrupt: model.safetensors"):
        latest_checkpoint(tmp_path)


@pytest.mark.slow
def test_a_kill_at_any_moment_leaves_a_resumable_run(tmp_path) -> None:
    """SIGKILL a training process that checkpoints every step; the newest checkpoint verifies and the run resumes."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "tapelm.cli", *tiny_cli(out, "--checkpoint-every", "1", "--keep-last", "2")]
    command[command.index("--steps") + 1] = "400"
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and len(list_checkpoints(out)) < 2:
        time.sleep(0.2)
    time.sleep(0.37)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    step, _ = latest_checkpoint(out)  # raises if the kill left a damaged newest checkpoint
    assert 0 < step < 400
    args = build_parser().parse_args(command[3:])
    run = resolve(spec_from_args(args, args.pe, args.seed))
    assert run_task(run, out, RunOptions(progress=False), resume=True, stop_after=step + 2) is None
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, step + 3))


def test_run_dir_of_another_configuration_is_refused_untouched(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert main(tiny_cli(out)) == 0
    before = snapshot(out)
    capsys.readouterr()
    assert main(tiny_cli(out, "--lr", "0.01", "--resume")) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "belongs to another configuration (different train)" in error
    assert main(tiny_cli(out)) == 2  # same configuration without --resume: the library's resume=True, as the flag
    assert "already holds a run; --resume continues it" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="already holds a run; resume=True continues it"):
        args = build_parser().parse_args(tiny_cli(out))
        run_task(resolve(spec_from_args(args, args.pe, args.seed)), out, RunOptions(progress=False))
    assert snapshot(out) == before
    assert main(tiny_cli(out, "--resume")) == 0  # a finished run: --resume returns its cached result
    assert snapshot(out) == before


def test_corrupt_checkpoints_are_a_one_line_error(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert main(tiny_cli(out, "--checkpoint-every", "2")) == 0
    (out / "result.json").unlink()  # pretend the run was interrupted after its last checkpoint
    for _, checkpoint in list_checkpoints(out):
        (checkpoint / "optimizer.bin").write_bytes(b"garbage")
    before = snapshot(out)
    capsys.readouterr()
    assert main(tiny_cli(out, "--resume", "--checkpoint-every", "2")) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "is corrupt: optimizer.bin" in error
    assert "no older checkpoint is intact; remove" in error
    assert snapshot(out) == before


def test_a_corrupt_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, caplog) -> None:
    out = tmp_path / "run"
    assert main(tiny_cli(out, "--checkpoint-every", "2")) == 0
    expected = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (out / "result.json").unlink()  # pretend the run was interrupted after its last checkpoint
    assert [step for step, _ in list_checkpoints(out)] == [2, 4]
    (list_checkpoints(out)[-1][1] / "optimizer.bin").write_bytes(b"garbage")
    with caplog.at_level("WARNING"):
        assert main(tiny_cli(out, "--resume", "--checkpoint-every", "2")) == 0
    assert "step-00000004' is corrupt: optimizer.bin" in caplog.text and "resuming from the intact" in caplog.text
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2, 3, 4]  # steps 3 and 4 trained again from step 2
    assert [m["loss"] for m in logged] == pytest.approx([m["loss"] for m in expected], rel=1e-5)
    assert latest_checkpoint(out)[0] == 4  # the damaged checkpoint was replaced by an intact one


def test_the_first_loss_is_logged_and_the_last_step_is_not_evaluated_twice(tmp_path) -> None:
    """A run shorter than its logging interval still reports its first loss; the quick in-training evaluation is
    not repeated after the last step when it falls off the eval_every schedule (the final evaluation covers it)."""
    out = tmp_path / "run"
    result = run_task(tiny_spec(steps=3, log_every=10, eval_every=2), out, RunOptions(progress=False))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 3]
    assert [r["step"] for r in records if "eval" in r] == [2]
    assert result["first_loss"] == records[0]["loss"] != result["final_loss"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--task", "sorting", "--pe", "tape"], "unknown task 'sorting'; choose one of: addition"),
        (["train", "--task", "addition", "--pe", "sine"], "unknown encoding 'sine'; choose from: tape, rope"),
        (
            ["train", "--task", "addition", "--pe", "tape", "--task-option", "max_train_digits=0"],
            "max_train_digits=0 is not allowed; it must be an integer in [1, 100]",
        ),
        (
            ["train", "--task", "passkey", "--pe", "tape", "--task-option", "train_length=100"],
            "train_length=100 is not allowed",
        ),
        (
            ["train", "--task", "text", "--pe", "tape", "--task-option", "corpus=/no/such/corpus"],
            "corpus path '/no/such/corpus' does not exist",
        ),
        (
            ["train", "--task", "text", "--pe", "tape", "--eval-n", "4"],
            "n=4 gives 256 held-out tokens, fewer than the eval length 512",
        ),
        (["train", "--task", "addition", "--pe", "tape", "--preset", "huge"], "unknown preset 'huge'; choose one of"),
        (["train", "--task", "addition", "--pe", "tape", "--schedule", "linear"], "schedule='linear' is not allowed"),
        (
            ["train", "--task", "addition", "--pe", "tape", "--model-option", "hidden_size=30"],
            "hidden_size=30 must be divisible by num_attention_heads=8",
        ),
        (
            ["train", "--task", "addition", "--pe", "tape", "--model-option", "num_hiden_layers=6"],
            "unknown model option 'num_hiden_layers'; choose from the TapeConfig fields: ",
        ),
        (
            ["train", "--task", "addition", "--pe", "tape", "--compile", "--compile-step"],
            "--compile and --compile-step compile the same forward two ways; choose one",
        ),
        (
            ["compare", "addition", "--pe", "tape", "--model-option", "hiden_size=64"],
            "unknown model option 'hiden_size'",
        ),
        (["compare", "addition", "--pe", "tape", "sine"], "unknown encoding 'sine'"),
        (["eval", "/no/such/run"], "'/no/such/run' is not a tapelm run directory"),
        (["report", "--root", "/no/such/root"], "results folder '/no/such/root' does not exist"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, monkeypatch, capsys, argv, message) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([*argv, "--no-progress"] if argv[0] in ("train", "compare") else argv) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and message in error
    assert list(tmp_path.iterdir()) == []


def test_eval_command_writes_json_and_png(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert main(tiny_cli(out)) == 0
    (out / "eval.json").unlink()
    (out / "eval.png").unlink()
    assert main(["eval", str(out), "--n", "3", "--no-progress"]) == 0
    evaluation = json.loads((out / "eval.json").read_text())
    assert evaluation["n"] == 3 and evaluation["metric"] == "exact_match"
    assert {(c["len_a"], c["len_b"]) for c in evaluation["conditions"]} == {
        (a, b) for a in range(1, 5) for b in range(1, 5)
    }
    assert (out / "eval.png").read_bytes()[:4] == b"\x89PNG"
    # The exact match equals the task's own scoring; token accuracy (same logits) is at least as high.
    from tapelm.experiments.runs import load_run

    run = load_run(out)
    model = run.load_model().eval()
    row = evaluation["conditions"][5]
    condition = {k: row[k] for k in ("len_a", "len_b", "length")}
    value, _ = run.task.evaluate_condition(
        lambda ids, mask: model(input_ids=ids, attention_mask=mask, use_cache=False).logits,
        condition,
        evaluation["seed"],
        3,
        64,
    )
    assert row["value"] == value and row["token_accuracy"] >= row["value"]


def test_reevaluating_a_finished_run_updates_its_result(tmp_path) -> None:
    """`tapelm eval` at the run's own test-set size and seed writes its numbers into result.json (what a comparison
    reads); another size leaves result.json alone."""
    out = tmp_path / "run"
    assert main(tiny_cli(out, "--pe", "randpe")) == 0
    result = json.loads((out / "result.json").read_text())
    own = dict(result, summary={"stale": True}, mean=-1.0)
    (out / "result.json").write_text(json.dumps(own))
    assert main(["eval", str(out), "--n", "3", "--no-progress"]) == 0
    assert json.loads((out / "result.json").read_text())["mean"] == -1.0
    assert main(["eval", str(out), "--no-progress"]) == 0
    evaluation = json.loads((out / "eval.json").read_text())
    refreshed = json.loads((out / "result.json").read_text())
    assert refreshed["summary"] == evaluation["summary"] == result["summary"] and refreshed["mean"] == result["mean"]


def test_evaluation_is_seeded_and_leaves_the_training_random_stream_alone() -> None:
    """RandPE draws its evaluation positions at random: the evaluation seeds torch's random state for itself and
    restores it afterwards."""
    from tapelm.experiments.evaluate import evaluate_model

    run = resolve(tiny_spec("randpe"))
    model = run.build_model()
    before = torch.random.get_rng_state()
    first = evaluate_model(model, run.task, 4, 64, progress=False)
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.manual_seed(99)
    assert evaluate_model(model, run.task, 4, 64, progress=False) == first


def test_a_run_written_before_a_config_field_existed_is_still_its_own(tmp_path) -> None:
    """A finished run whose saved config lacks a field TapeConfig gained later (at its default) is the same run."""
    out = tmp_path / "run"
    assert main(tiny_cli(out)) == 0
    saved = json.loads((out / "run.json").read_text())
    del saved["identity"]["model"]["randpe_eval_positions"]
    (out / "run.json").write_text(json.dumps(saved))
    before = snapshot(out)
    assert main(tiny_cli(out, "--resume")) == 0
    assert snapshot(out) == before


def test_position_tables_cover_the_longest_evaluation() -> None:
    for pe in ("learned", "randpe"):
        run = resolve(RunSpec(task="addition", pe=pe, task_options=TINY_TASK, model_options=TINY_MODEL))
        assert run.config.max_position_embeddings >= run.task.max_eval_length
        assert run.config.randpe_max_position >= run.task.max_eval_length


def test_match_params_widens_the_baseline_mlp_to_tape() -> None:
    tape = resolve(RunSpec(task="addition", pe="tape", task_options=TINY_TASK, model_options=TINY_MODEL))
    plain = resolve(RunSpec(task="addition", pe="nope", task_options=TINY_TASK, model_options=TINY_MODEL))
    matched = resolve(
        RunSpec(task="addition", pe="nope", task_options=TINY_TASK, model_options=TINY_MODEL, match_params=True)
    )
    assert plain.parameters < tape.parameters <= matched.parameters
    assert matched.parameters - tape.parameters < 3 * 32 * 2  # within one MLP unit
    assert matched.config.intermediate_size > plain.config.intermediate_size
    assert matched.settings_hash != plain.settings_hash


def test_a_presets_model_size_is_part_of_the_comparison_identity(monkeypatch) -> None:
    from dataclasses import replace

    from tapelm.experiments import presets

    before = resolve(RunSpec(task="addition", pe="rope", task_options=TINY_TASK))
    small = presets.PRESETS["cpu-small"]
    resized = replace(small["addition"], model=replace(small["addition"].model, num_hidden_layers=2))
    monkeypatch.setitem(presets.PRESETS, "cpu-small", {**small, "addition": resized})
    after = resolve(RunSpec(task="addition", pe="rope", task_options=TINY_TASK))
    assert after.config.num_hidden_layers == 2 and after.settings_hash != before.settings_hash


def test_the_data_stream_is_seeded_by_index_and_seed() -> None:
    run = resolve(tiny_spec())
    a, b = batch_stream(run.task, 0, 8), batch_stream(run.task, 1, 8)
    assert torch.equal(a(5)["input_ids"], batch_stream(run.task, 0, 8)(5)["input_ids"])
    assert not torch.equal(a(5)["input_ids"], a(6)["input_ids"])
    assert not torch.equal(a(5)["input_ids"], b(5)["input_ids"])


def test_batches_made_by_worker_processes_are_the_stream_in_order(tmp_path) -> None:
    """`data_workers` only makes the batches ahead: the same batches, so the same losses, and an exact resume."""
    run = resolve(tiny_spec(steps=6, grad_accum=2))
    stream = batch_stream(run.task, 0, 8)
    ahead = list(micro_batches(stream, 3, 2, 5, workers=2))
    assert len(ahead) == 5 and all(
        torch.equal(batch["input_ids"], stream(3 + 2 * i)["input_ids"]) for i, batch in enumerate(ahead)
    )

    def losses(directory, workers, stop_after=None, resume=False):
        return train(
            run.build_model(),
            stream,
            run.settings,
            directory,
            resume=resume,
            options=LoopOptions(progress=False, data_workers=workers, stop_after=stop_after),
        ).losses

    alone = losses(tmp_path / "alone", 0)
    assert losses(tmp_path / "ahead", 2) == alone
    settings = replace(run.settings, checkpoint_every=3)
    run.settings = settings
    assert losses(tmp_path / "resumed", 2, stop_after=3) == alone[:3]
    assert losses(tmp_path / "resumed", 1, resume=True) == alone[3:]
    with pytest.raises(ValueError, match="data_workers=-1 is not allowed"):
        losses(tmp_path / "bad", -1)


@pytest.mark.parametrize("options", [{"mixed_precision": "bf16"}, {"grad_checkpointing": True, "grad_accum": 2}])
def test_mixed_precision_and_gradient_checkpointing_train(tmp_path, options) -> None:
    run = resolve(tiny_spec(steps=3, **options))
    model = run.build_model()
    result = train(model, batch_stream(run.task, 0, 8), run.settings, tmp_path, options=QUIET)
    assert len(result.losses) == 3 and all(torch.isfinite(torch.tensor(result.losses)))
    if options.get("grad_checkpointing"):
        assert model.model.gradient_checkpointing


def test_out_naming_a_file_is_refused(tmp_path, capsys) -> None:
    (tmp_path / "run").write_text("a file")
    assert main(tiny_cli(tmp_path / "run")) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "--out '" in error and "is a file; give a run folder" in error


def test_provenance_trusts_git_only_where_tapelm_is_the_checkout(tmp_path) -> None:
    """tapelm's own checkout gives its commit; a copy of the source inside another project's git checkout (as a GPU
    visit once unpacked it) gives no commit rather than that project's."""
    import shutil
    import subprocess
    import sys

    from tapelm.training import provenance

    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=provenance.SOURCE_ROOT
    ).stdout.strip()
    if head:
        assert provenance.environment()["commit"] == head
    outer = tmp_path / "other-project"
    shutil.copytree(
        provenance.SOURCE_ROOT / "src" / "tapelm",
        outer / "copy" / "src" / "tapelm",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    for command in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
        subprocess.run(["git", *command], cwd=outer, check=True, capture_output=True)
    script = (
        "import json, sys; sys.path.insert(0, 'copy/src'); from tapelm.training import provenance as p; "
        "print(json.dumps([p._git('rev-parse', 'HEAD'), p.SOURCE_ROOT.name]))"
    )
    printed = subprocess.run([sys.executable, "-c", script], cwd=outer, capture_output=True, text=True, check=True)
    assert json.loads(printed.stdout) == [None, "copy"]


def test_a_run_from_a_source_checkout_that_is_not_installed_writes_its_records(tmp_path, monkeypatch) -> None:
    """Without tapelm's package metadata (PYTHONPATH=src) every record is written; the commit identifies the code."""
    import importlib.metadata

    from tapelm.training import provenance

    def version(package):
        if package == "tapelm":
            raise importlib.metadata.PackageNotFoundError(package)
        return importlib.metadata.version(package)

    monkeypatch.setattr(provenance, "version", version)
    assert main(tiny_cli(tmp_path / "run")) == 0
    record = json.loads((tmp_path / "run" / "result.json").read_text())
    assert record["environment"]["tapelm"] == "source tree (not installed)"
