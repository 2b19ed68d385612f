"""The experiment commands: `tapelm train`, `tapelm eval` and `tapelm compare`, and the options they share."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import torch

from ..positional import encoding_names
from ..training.devices import process_device
from ..training.flags import TRAIN_FLAGS, add_train_flags
from ..training.launchers import Launcher, LocalLauncher, SlurmLauncher
from ..training.trackers import TRACKERS
from ..variants import ABLATIONS, AT_EVALUATION, GATED_SUFFIX, MECHANISMS, VARIANTS, trained_row
from .compare import DEFAULT_PES, compare
from .evaluate import EVAL_SEED, evaluate_model
from .ladder import LADDER_TASKS, climb, rungs, write_prediction
from .presets import DEFAULT_PRESET, PRESETS, get_preset
from .runs import RunOptions, RunSpec, load_run, resolve, run_task, write_evaluation
from .sharing import measure_sharing, sharing_spec
from .stage import run_stage
from .sweep import sweep
from .tasks import TASKS
from .tune import TUNING_SEEDS, tune, tuned_rates

LAUNCHERS = ("local", "slurm")
# The library's argument names -> the flags that set them, for error messages (`as_flags`).
FLAGS = {
    "compile_layers=True": "--compile",
    "compile_step=True": "--compile-step",
    "resume=True": "--resume",
    "SlurmLauncher": "--launcher slurm",
    "jobs=": "--jobs=",
    "data_workers=": "--data-workers=",
    "checkpoint_minutes=": "--checkpoint-minutes=",
    "report_to=": "--report-to=",
    "time_minutes=": "--slurm-time=",
    "gpus_per_run=": "--slurm-gpus-per-run=",
    "cpus_per_run=": "--slurm-cpus-per-run=",
    "budget_seconds=": "--budget-seconds=",
    "out=": "--out=",
    "tasks=": "--tasks=",
}
_FLAG_PATTERN = re.compile("|".join(rf"(?<![\w-]){re.escape(name)}" for name in FLAGS))


def say(line: str) -> None:
    """A library's progress or result line, printed as it comes."""
    print(line, flush=True)


def as_flags(message: str) -> str:
    """A library error's message with the arguments it names said as the command's flags (`FLAGS`)."""
    return _FLAG_PATTERN.sub(lambda match: FLAGS[match.group(0)], message)


def parse_options(pairs: list[str] | None, flag: str) -> dict[str, Any]:
    """KEY=VALUE pairs; VALUE is read as JSON when it parses (numbers, true/false, lists), a comma list of numbers
    as a list, else as a string."""
    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} {pair!r} is not allowed; write KEY=VALUE")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            parts = text.split(",")
            try:
                value = [json.loads(p) for p in parts] if len(parts) > 1 else text
            except json.JSONDecodeError:
                value = text
        options[key.replace("-", "_")] = value
    return options


def add_run_arguments(parser, exclude: tuple[str, ...] = ()) -> None:
    """The options shared by `tapelm train`, `compare` and `sweep` (less the training flags in `exclude`)."""
    parser.add_argument("--preset", default=DEFAULT_PRESET, help=f"one of: {', '.join(PRESETS)} (default: %(default)s)")
    parser.add_argument(
        "--task-option",
        action="append",
        metavar="KEY=VALUE",
        help="a task option over the preset's, e.g. max_train_digits=10 (repeatable)",
    )
    parser.add_argument(
        "--model-option",
        action="append",
        metavar="KEY=VALUE",
        help="a TapeConfig field over the preset's, e.g. num_hidden_layers=6 (repeatable)",
    )
    add_train_flags(parser, exclude)
    parser.add_argument("--eval-n", type=int, help="examples per evaluation condition (default: the preset's)")
    parser.add_argument("--eval-batch-size", type=int, help="evaluation batch size (default: the preset's)")
    parser.add_argument("--match-params", action="store_true", help="widen a baseline's MLP to TAPE's parameter count")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: the preset's; cpu-small uses 1, "
        "which is much faster for its tiny models on a busy machine)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="train with torch.compile'd decoder layers (inductor; evaluation stays eager): faster "
        "steps after seconds of compiling, the same function to float rounding, so not part of "
        "a run's identity",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_report_to(parser) -> None:
    parser.add_argument(
        "--report-to",
        nargs="+",
        default=["none"],
        metavar="TRACKER",
        help=f"experiment trackers each run logs to live, through accelerate: any of "
        f"{', '.join(TRACKERS)}, or none (default); they do not change a run's numbers",
    )


def add_checkpoint_minutes(parser) -> None:
    parser.add_argument(
        "--checkpoint-minutes",
        type=float,
        metavar="MINUTES",
        help="also checkpoint every MINUTES of training (at a log step), so that a run a deadline or a "
        "preemption stops resumes from at most that long ago; 0: only --checkpoint-every's (default: the "
        "preset's: 3 in gpu, 0 elsewhere); a resumed run ends as an unbroken one, so not part of a run's identity",
    )


def add_launch_arguments(parser) -> None:
    """Where the runs train (`launchers`): --launcher, --jobs, the SLURM options, --data-workers, --report-to."""
    parser.add_argument(
        "--launcher",
        default="local",
        choices=LAUNCHERS,
        help="local: this machine (default); slurm: a SLURM cluster through submitit, the runs as one "
        "job array, results collected as they land",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="local: runs trained at once on each device, each in a process of its own pinned to "
        "its device: on CUDA, N per visible GPU; on the CPU, N with the preset's threads each "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--data-workers",
        type=int,
        default=0,
        help="processes that make the batches ahead of the device, split between the runs trained "
        "at once (default: %(default)s)",
    )
    parser.add_argument("--slurm-partition", help="slurm: the partition each job asks for (default: the cluster's)")
    parser.add_argument(
        "--slurm-time",
        type=int,
        metavar="MINUTES",
        help="slurm: each job's time limit; a job that reaches it is requeued and resumes from its "
        "checkpoint (default: 60)",
    )
    parser.add_argument(
        "--slurm-gpus-per-run", type=int, help="slurm: GPUs of each job: 1 (default), or 0 on CPU nodes"
    )
    parser.add_argument("--slurm-cpus-per-run", type=int, help="slurm: CPUs of each job (default: the cluster's)")
    add_report_to(parser)


def launcher_from_args(args) -> Launcher:
    """The launcher of `add_launch_arguments`' options (submitit's files in ROOT/slurm), printing its progress
    lines; ValueError, before anything starts, for a bad option or an option of the other launcher."""
    slurm = {
        "--slurm-partition": args.slurm_partition,
        "--slurm-time": args.slurm_time,
        "--slurm-gpus-per-run": args.slurm_gpus_per_run,
        "--slurm-cpus-per-run": args.slurm_cpus_per_run,
    }
    if args.launcher not in LAUNCHERS:
        raise ValueError(f"--launcher {args.launcher!r} is not allowed; choose from: {', '.join(LAUNCHERS)}")
    if args.launcher == "local":
        given = [flag for flag, value in slurm.items() if value is not None]
        if given:
            raise ValueError(f"{given[0]} is an option of --launcher slurm; add --launcher slurm or leave it out")
        return LocalLauncher(args.jobs, log=say)
    if args.jobs != 1:
        raise ValueError(
            "--jobs is an option of --launcher local; on SLURM every run is a job of its own, with one GPU"
        )
    return SlurmLauncher(
        Path(args.root) / "slurm",
        args.slurm_partition,
        60 if args.slurm_time is None else args.slurm_time,
        1 if args.slurm_gpus_per_run is None else args.slurm_gpus_per_run,
        args.slurm_cpus_per_run,
        log=say,
    )


def run_options_from_args(args) -> RunOptions:
    """The `RunOptions` of a command's flags (ValueError for a bad one, before anything starts)."""
    return RunOptions(
        progress=not args.no_progress,
        compile_layers=getattr(args, "compile", False),
        data_workers=getattr(args, "data_workers", 0),
        report_to=args.report_to,
        compile_step=getattr(args, "compile_step", None),
        checkpoint_minutes=getattr(args, "checkpoint_minutes", None),
    )


def apply_threads(args) -> None:
    """--threads, else the preset's thread count (cpu-small: 1), else torch's default."""
    threads = args.threads
    if threads is not None and threads < 1:
        raise ValueError(f"--threads={threads} is not allowed; it must be a positive integer")
    if threads is None and args.preset in PRESETS:
        threads = get_preset(args.preset, args.task).threads
    if threads is not None:
        torch.set_num_threads(threads)


def train_options(args) -> dict[str, Any]:
    options = {name: getattr(args, name) for name in TRAIN_FLAGS if getattr(args, name, None) is not None}
    if args.grad_checkpointing:
        options["grad_checkpointing"] = True
    return options


def spec_from_args(args, pe: str, seed: int) -> RunSpec:
    return RunSpec(
        task=args.task,
        pe=pe,
        seed=seed,
        preset=args.preset,
        task_options=parse_options(args.task_option, "--task-option"),
        model_options=parse_options(args.model_option, "--model-option"),
        train_options=train_options(args),
        eval_n=args.eval_n,
        eval_batch_size=args.eval_batch_size,
        match_params=args.match_params,
    )


def _add_train(commands) -> None:
    parser = commands.add_parser("train", help="train one model on a task, then evaluate it over lengths")
    parser.add_argument("--task", required=True, help=f"one of: {', '.join(TASKS)}")
    parser.add_argument("--pe", required=True, help=f"positional encoding, one of: {', '.join(encoding_names())}")
    parser.add_argument("--seed", type=int, default=0, help="training seed (default: %(default)s)")
    parser.add_argument("--out", help="run directory (default: runs/train/TASK-PE-seedSEED)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    add_run_arguments(parser)
    add_report_to(parser)
    add_checkpoint_minutes(parser)
    parser.add_argument(
        "--compile-step",
        action="store_true",
        default=None,
        help="compile the whole model's training forward for the run's shapes, with CUDA graphs on a "
        "GPU (minutes of compiling on a CPU; evaluation stays eager; default: the preset's "
        "choice, off in every preset): the same function to float rounding, so not part of a "
        "run's identity",
    )
    parser.set_defaults(handler=_train_command)


def _train_command(args) -> None:
    spec = spec_from_args(args, args.pe, args.seed)
    run = resolve(spec)
    apply_threads(args)
    out = Path(args.out or f"runs/train/{spec.task}-{spec.pe}-seed{spec.seed}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out '{out}' is a file; give a run folder")
    result = run_task(run, out, run_options_from_args(args), resume=args.resume)
    if result is not None:
        summary = result["summary"]
        print(
            f"{spec.task} / {spec.pe} / seed {spec.seed}: loss {result['first_loss']:.3f} -> "
            f"{result['final_loss']:.3f}; {result['metric']} in-distribution {summary['in_distribution']:.4f}, "
            f"longer {summary['longer']:.4f}, all {summary['all']:.4f}"
        )
        print(f"wrote {out}/result.json, {out}/eval.json and {out}/eval.png")


def print_evaluation(evaluation: dict[str, Any]) -> None:
    summary = evaluation["summary"]
    print(
        f"{evaluation['task']}: {evaluation['metric']} in-distribution {summary['in_distribution']:.4f}, "
        f"longer {summary['longer']:.4f}, all {summary['all']:.4f}"
    )
    print(
        "by length ("
        + evaluation["x_label"]
        + "): "
        + ", ".join(f"{k}: {v:.3f}" for k, v in summary["by_length"].items())
    )


def evaluate_run(
    run_dir: str | Path,
    n: int | None = None,
    batch_size: int | None = None,
    seed: int = EVAL_SEED,
    progress: bool = True,
) -> dict[str, Any]:
    """`tapelm eval RUN_DIR`: evaluate the run's final model; writes eval.json and eval.png in the run directory
    (and the new numbers into result.json when this is the run's own evaluation)."""
    run = load_run(run_dir)
    model = run.load_model().to(process_device())
    n = n or run.preset.eval_n
    batch_size = batch_size or run.preset.eval_batch_size
    evaluation = evaluate_model(model, run.task, n, batch_size, seed, progress)
    write_evaluation(run, Path(run_dir), evaluation)
    return evaluation


def _add_eval(commands) -> None:
    parser = commands.add_parser("eval", help="evaluate a trained run over lengths (JSON + PNG in the run dir)")
    parser.add_argument("run_dir", help="a run directory written by `tapelm train` or `tapelm compare`")
    parser.add_argument("--n", type=int, help="examples per condition (default: the preset's)")
    parser.add_argument("--batch-size", type=int, help="evaluation batch size (default: the preset's)")
    parser.add_argument("--seed", type=int, default=EVAL_SEED, help="evaluation data seed (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=_eval_command)


def _eval_command(args) -> None:
    for name in ("n", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')}={value} is not allowed; it must be a positive integer")
    evaluation = evaluate_run(args.run_dir, args.n, args.batch_size, args.seed, progress=not args.no_progress)
    print_evaluation(evaluation)
    print(f"wrote {Path(args.run_dir) / 'eval.json'} and {Path(args.run_dir) / 'eval.png'}")


def _add_compare(commands) -> None:
    parser = commands.add_parser(
        "compare", help="train and evaluate one model per encoding and seed with identical budgets; table + figures"
    )
    parser.add_argument("task", help=f"one of: {', '.join(TASKS)}")
    parser.add_argument(
        "--pe",
        nargs="+",
        default=list(DEFAULT_PES),
        metavar="PE",
        help=f"encodings (default: {' '.join(DEFAULT_PES)}); any of: {', '.join(encoding_names())}, the options rows "
        f"{', '.join(MECHANISMS)}, any encoding gated (its name + '{GATED_SUFFIX}'), the rows evaluated from "
        f"another's models under a RoPE scaling "
        f"{', '.join(AT_EVALUATION)}, TAPE's variants {', '.join(VARIANTS)}, or 'all' (the pe_types)",
    )
    parser.add_argument(
        "--tuned",
        nargs="?",
        const="docs/results/tune",
        metavar="DIR",
        help="train each encoding at the rate `tapelm tune` chose for it (its record in DIR, default "
        "docs/results/tune), in the comparison HASH-tuned beside the shared rate's HASH",
    )
    _add_comparison_arguments(parser, seeds=[0])
    parser.set_defaults(handler=_compare_command)


def _add_comparison_arguments(parser, seeds: list[int]) -> None:
    """Seeds, cache folder and parallel jobs of a comparison, then the run options."""
    parser.add_argument(
        "--seeds", nargs="+", type=int, default=seeds, help=f"training seeds (default: {' '.join(map(str, seeds))})"
    )
    parser.add_argument("--root", default="runs", help="results cache folder (default: %(default)s)")
    parser.add_argument(
        "--archive",
        metavar="DIR",
        help="count as done the finished runs of this comparison that `tapelm report` archived in "
        "DIR (docs/results/compare), copying their results into --root: continues a "
        "comparison on a machine without its runs/ cache",
    )
    add_launch_arguments(parser)
    add_run_arguments(parser)


def _compare_command(args) -> None:
    pes = list(encoding_names()) if args.pe == ["all"] else args.pe
    trained = list(dict.fromkeys(map(trained_row, pes)))
    base = spec_from_args(args, trained[0] if pes else "tape", 0)
    if args.tuned is not None and args.lr is not None:
        raise ValueError("--tuned trains each encoding at its tuned rate; leave out --lr")
    rates = tuned_rates(args.tuned, base, trained) if args.tuned is not None else None
    launcher = launcher_from_args(args)
    apply_threads(args)
    compare(
        base,
        pes,
        args.seeds,
        root=args.root,
        progress=not args.no_progress,
        compile_layers=args.compile,
        archive=args.archive,
        launcher=launcher,
        data_workers=args.data_workers,
        report_to=args.report_to,
        log=say,
        rates=rates,
    )


def _add_ablate(commands) -> None:
    parser = commands.add_parser(
        "ablate", help="TAPE's ablations (the paper's table) as one comparison: same budget, paired by seed"
    )
    parser.add_argument("task", help=f"one of: {', '.join(TASKS)}")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(ABLATIONS),
        metavar="VARIANT",
        help=f"variants (default: all of {', '.join(ABLATIONS)})",
    )
    _add_comparison_arguments(parser, seeds=[0, 1, 2])
    parser.set_defaults(handler=_ablate_command)


def _ablate_command(args) -> None:
    unknown = [name for name in args.variants if name not in ABLATIONS]
    if unknown:
        raise ValueError(f"unknown ablation variant '{unknown[0]}'; choose from: {', '.join(ABLATIONS)}")
    base = spec_from_args(args, "tape", 0)
    launcher = launcher_from_args(args)
    apply_threads(args)
    compare(
        base,
        args.variants,
        args.seeds,
        root=args.root,
        progress=not args.no_progress,
        ablation=True,
        compile_layers=args.compile,
        archive=args.archive,
        launcher=launcher,
        data_workers=args.data_workers,
        report_to=args.report_to,
        log=say,
    )


def _add_sweep(commands) -> None:
    parser = commands.add_parser(
        "sweep",
        help="learning curves over encodings, seeds, learning rates and schedules (JSON + PNG), to choose "
        "a recipe that learns on every seed",
    )
    parser.add_argument("task", help=f"one of: {', '.join(TASKS)}")
    parser.add_argument(
        "--pe",
        nargs="+",
        default=["rope"],
        help=f"positional encodings (default: %(default)s); from: {', '.join(encoding_names())}",
    )
    parser.add_argument("--seeds", "--seed", type=int, nargs="+", default=[0], help="training seeds (default: 0)")
    parser.add_argument("--lr", type=float, nargs="+", required=True, help="peak learning rates to try")
    parser.add_argument("--schedule", nargs="+", help="learning-rate schedules to try (default: the preset's)")
    parser.add_argument("--name", help="file name of the JSON and PNG, without suffix (default: TASK-PE...-sweep)")
    parser.add_argument("--root", default="runs", help="results cache folder (default: %(default)s)")
    parser.add_argument("--out", default="docs/sweeps", help="folder for the JSON and PNG (default: %(default)s)")
    add_run_arguments(parser, exclude=("lr", "schedule"))
    parser.set_defaults(handler=_sweep_command)


def _sweep_command(args) -> None:
    swept = argparse.Namespace(**{**vars(args), "lr": None, "schedule": None})  # swept settings come from the grid
    for pe in args.pe:
        resolve(spec_from_args(swept, pe, args.seeds[0]))  # refuses a bad task, encoding or option before any run
    apply_threads(args)
    sweep(
        spec_from_args(swept, args.pe[0], args.seeds[0]),
        args.lr,
        root=args.root,
        out=args.out,
        progress=not args.no_progress,
        pes=args.pe,
        seeds=args.seeds,
        schedules=args.schedule,
        name=args.name,
        compile_layers=args.compile,
        log=say,
    )


def _add_tune(commands) -> None:
    parser = commands.add_parser(
        "tune",
        help="each encoding's own peak learning rate for a task's recipe, by the protocol of docs/RECIPES.md: the "
        "shared rate x1/3, x1, x3 (one step further at an edge), on tuning seeds, scored on a validation set",
    )
    parser.add_argument("task", help=f"one of: {', '.join(TASKS)}")
    parser.add_argument(
        "--pe",
        nargs="+",
        required=True,
        metavar="PE",
        help=f"encodings or option rows to tune; any of: {', '.join(encoding_names())}, {', '.join(MECHANISMS)}, "
        f"any encoding gated (its name + '{GATED_SUFFIX}')",
    )
    parser.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=list(TUNING_SEEDS),
        help="tuning seeds, none of a comparison's (default: %(default)s)",
    )
    parser.add_argument("--root", default="runs", help="results cache folder (default: %(default)s)")
    parser.add_argument(
        "--out", default="docs/results/tune", help="folder of the tuning records TASK/HASH.json (default: %(default)s)"
    )
    add_launch_arguments(parser)
    add_run_arguments(parser, exclude=("lr",))
    parser.set_defaults(handler=_tune_command)


def _tune_command(args) -> None:
    launcher = launcher_from_args(args)
    apply_threads(args)
    tune(
        spec_from_args(argparse.Namespace(**{**vars(args), "lr": None}), args.pe[0], args.seeds[0]),
        args.pe,
        args.seeds,
        root=args.root,
        out=args.out,
        progress=not args.no_progress,
        launcher=launcher,
        compile_layers=args.compile,
        data_workers=args.data_workers,
        report_to=args.report_to,
        log=say,
    )


def _add_stage(commands) -> None:
    parser = commands.add_parser(
        "stage",
        help="the comparisons owed at GPU scale, in pieces: the next planned runs that fit in "
        "--budget-seconds, each finished run's results written into --out (merge them into the archive "
        "with `tapelm report --root OUT`)",
    )
    parser.add_argument(
        "--budget-seconds",
        type=float,
        required=True,
        help="wall-clock seconds the stage may take; a run expected to take longer is not started",
    )
    parser.add_argument(
        "--out",
        default="runs/stage",
        help="folder for the finished runs' result files and stage.json (default: %(default)s)",
    )
    parser.add_argument(
        "--archive",
        metavar="DIR",
        help="count the runs archived in DIR (docs/results/compare) as done, and continue after them",
    )
    parser.add_argument("--root", default="runs", help="results cache folder, where runs train (default: %(default)s)")
    add_launch_arguments(parser)
    parser.add_argument("--tasks", nargs="+", metavar="TASK", help="only the comparisons of these tasks")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the plan and its predicted GPU minutes; train nothing"
    )
    parser.add_argument(
        "--model-option",
        action="append",
        metavar="KEY=VALUE",
        help="a TapeConfig field over every planned recipe's: another comparison (tests, trials)",
    )
    add_train_flags(parser)
    parser.add_argument("--eval-n", type=int, help="examples per evaluation condition over the recipes'")
    parser.add_argument("--eval-batch-size", type=int, help="evaluation batch size over the recipes'")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_checkpoint_minutes(parser)
    parser.set_defaults(handler=_stage_command)


def _stage_command(args) -> int:
    overrides = {
        "model_options": parse_options(args.model_option, "--model-option"),
        "train_options": train_options(args),
        "eval_n": args.eval_n,
        "eval_batch_size": args.eval_batch_size,
    }
    return run_stage(
        args.budget_seconds,
        args.out,
        root=args.root,
        archive=args.archive,
        data_workers=args.data_workers,
        tasks=args.tasks,
        progress=not args.no_progress,
        dry_run=args.dry_run,
        overrides={k: v for k, v in overrides.items() if v not in (None, {})},
        launcher=launcher_from_args(args),
        report_to=args.report_to,
        checkpoint_minutes=args.checkpoint_minutes,
        log=say,
    )


def _add_sharing(commands) -> None:
    parser = commands.add_parser(
        "sharing",
        help="whether runs sharing one GPU pay: a short run of TASK's GPU recipe trained 1, 2, 4 ... at once on "
        "one device, and the device's training throughput at each against one run alone (JSON)",
    )
    parser.add_argument("task", help=f"one of: {', '.join(TASKS)}")
    parser.add_argument(
        "--pe", default="tape", choices=encoding_names(), metavar="PE", help="encoding (default: %(default)s)"
    )
    parser.add_argument(
        "--runs", type=int, nargs="+", default=[1, 2, 4], help="runs at once to measure (default: 1 2 4)"
    )
    parser.add_argument("--steps", type=int, default=100, help="training steps of each run (default: %(default)s)")
    parser.add_argument(
        "--device", default="0", help="the device every run shares, as CUDA_VISIBLE_DEVICES names it (default: 0)"
    )
    parser.add_argument(
        "--root", default="runs/sharing", help="folder for the runs and sharing.json (default: %(default)s)"
    )
    parser.set_defaults(handler=_sharing_command)


def _sharing_command(args) -> None:
    spec = sharing_spec(args.task, args.pe, args.steps)
    resolve(spec)  # refuses a bad task or encoding before any run (measure_sharing the counts and steps)
    measure_sharing(spec, args.runs, args.device, args.root, log=say)


def _add_ladder(commands) -> None:
    parser = commands.add_parser(
        "ladder",
        help="the compute ladder: TAPE against RoPE at rungs from the laptop recipe toward the GPU recipe, and the "
        "trend's prediction for the GPU rung",
    )
    parser.add_argument("task", help=f"one of: {', '.join(LADDER_TASKS)}")
    parser.add_argument(
        "--rungs",
        nargs="+",
        type=float,
        default=[1, 3, 10],
        metavar="FACTOR",
        help="rungs as multiples of the laptop run's training FLOPs (default: 1 3 10; 1 is the laptop recipe)",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="training seeds (default: 0 1 2)")
    parser.add_argument("--root", default="runs", help="results cache folder (default: %(default)s)")
    parser.add_argument(
        "--archive",
        metavar="DIR",
        help="reuse the finished runs `tapelm report` archived in DIR (docs/results/compare)",
    )
    parser.add_argument(
        "--predict",
        metavar="DIR",
        help="after the rungs, fit the trend and write its prediction for the GPU recipe to DIR/TASK.json "
        "(docs/results/ladder), once",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default: 1)")
    parser.add_argument("--list", action="store_true", help="print each rung's recipe and compute, train nothing")
    add_launch_arguments(parser)
    parser.set_defaults(handler=_ladder_command)


def _ladder_command(args) -> None:
    if args.threads < 1:
        raise ValueError(f"--threads={args.threads} is not allowed; it must be a positive integer")
    launcher = launcher_from_args(args)
    found = rungs(args.task, args.rungs)  # refuses a bad task or factor before anything trains
    if args.list:
        for rung in found:
            say(
                f"{rung.nominal:g}x: t = {rung.t}, {rung.factor:.2f}x the laptop's training FLOPs; "
                f"model {rung.spec.model_options or 'as the laptop'}, "
                f"training {rung.spec.train_options or 'as the laptop'}"
            )
        return
    torch.set_num_threads(args.threads)
    climbed = climb(args.task, args.rungs, args.seeds, args.root, args.archive, launcher, log=say)
    if args.predict:
        path = write_prediction(args.task, climbed, args.predict)
        say(f"wrote {path}")


def add_commands(commands) -> None:
    """Register train, eval, compare, ablate, sweep, tune, stage, sharing and ladder on the sub-command parser
    `commands`."""
    _add_train(commands)
    _add_eval(commands)
    _add_compare(commands)
    _add_ablate(commands)
    _add_sweep(commands)
    _add_tune(commands)
    _add_stage(commands)
    _add_sharing(commands)
    _add_ladder(commands)
