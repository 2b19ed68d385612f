"""`tapelm scrolls finetune | predict | score | run | laptop`.

Every argument is checked before any work or any write: a bad one is a one-line error naming the field and the
allowed values (exit status 2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ..training.devices import process_device
from ..training.flags import add_train_flags
from .tasks import ALL_TASKS, TASKS, get_task

TRAIN_FLAGS = {
    "steps": int,
    "lr": float,
    "warmup": int,
    "batch_size": int,
    "grad_accum": int,
    "mixed_precision": str,
    "checkpoint_every": int,
    "min_lr_ratio": float,
    "weight_decay": float,
    "schedule": str,
    "log_every": int,
}


def _threads(args) -> None:
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads={args.threads} is not allowed; it must be a positive integer")
        torch.set_num_threads(args.threads)


def _check_folder(flag: str, path) -> None:
    if Path(path).exists() and not Path(path).is_dir():
        raise ValueError(f"{flag} '{path}' is a file; give a folder")


def _tasks(name: str) -> list[str]:
    if name == "all":
        return list(TASKS)
    get_task(name)
    return [name]


def _common(parser, task_help: str) -> None:
    parser.add_argument("task", help=task_help)
    parser.add_argument(
        "--data",
        help="a SCROLLS-format .jsonl / .json / .parquet file, or a folder with "
        "{split}.jsonl or {split}.parquet (default: the Hub's tau/scrolls, online)",
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _finetune_arguments(parser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="a `tapelm train --task text` run folder, a tapelm or "
        "Llama-family checkpoint folder, a .gguf or a source name",
    )
    parser.add_argument(
        "--preset",
        default="cpu-small",
        help="cpu-small (default) or paper (the paper's GPU recipe: 8192 tokens, 64 x 1000 steps, lr 1e-5)",
    )
    parser.add_argument("--context", type=int, help="tokens of prompt + target (default: the preset's)")
    parser.add_argument("--target-cap", type=int, help="target tokens kept (default: 1000 summaries, 200 QA/NLI)")
    parser.add_argument(
        "--position-interpolation",
        action="store_true",
        help="linear position interpolation by context / pretraining length (RoPE family)",
    )
    parser.add_argument(
        "--pretrained-length",
        type=int,
        help="the source's pretraining length (default: the text run's train_length or max_position_embeddings)",
    )
    parser.add_argument(
        "--pe",
        help="tape or rope: the encoding a Llama-family source is converted to (default: "
        "tape); a tapelm source keeps its own",
    )
    add_train_flags(parser, flags=TRAIN_FLAGS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, help="use at most this many training ids")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out")


def _spec(args, task: str, out: Path):
    from .finetune import FinetuneSpec, check_spec

    options = {name: getattr(args, name) for name in TRAIN_FLAGS if getattr(args, name) is not None}
    if args.grad_checkpointing:
        options["grad_checkpointing"] = True
    spec = FinetuneSpec(
        source=args.model,
        task=task,
        data=args.data,
        preset=args.preset,
        context=args.context,
        target_cap=args.target_cap,
        position_interpolation=args.position_interpolation,
        pretrained_length=args.pretrained_length,
        pe=args.pe,
        train_options=options,
        seed=args.seed,
        limit=args.limit,
    )
    check_spec(spec)
    return spec


def _check_source(model: str) -> None:
    from ..pretrained.sources import PRETRAINED_SOURCES

    path = Path(model).expanduser()
    if not path.exists() and model not in PRETRAINED_SOURCES:
        raise ValueError(
            f"--model {model!r} does not exist; give a run or checkpoint folder, a .gguf file or one "
            f"of: {', '.join(PRETRAINED_SOURCES)}"
        )


def _cli_finetune(args) -> None:
    get_task(args.task)
    _check_source(args.model)
    _check_folder("--out", args.out)
    spec = _spec(args, args.task, Path(args.out))
    _threads(args)
    from .finetune import finetune

    record = finetune(spec, args.out, resume=args.resume, progress=not args.no_progress)
    print(
        f"{args.task}: fine-tuned at {record['context']} tokens on {record['training_rows']} rows; loss "
        f"{record['first_loss']:.3f} -> {record['final_loss']:.3f}; model in {Path(args.out) / 'model'}"
    )


def _decode_arguments(parser) -> None:
    parser.add_argument("--split", default="validation", help="train, validation (default) or test")
    parser.add_argument("--max-new-tokens", type=int, help="default: the target cap (1000 summaries, 200 QA/NLI)")
    parser.add_argument("--top-k", type=int, help="default: 3 (sampling) for summaries, 1 (greedy) otherwise")
    parser.add_argument(
        "--predict-batch-size", type=int, default=8, help="sequences generated together (default: %(default)s)"
    )
    parser.add_argument("--predict-limit", type=int, help="predict at most this many examples")


def _decode_settings(args):
    """The decoding options, checked (before any fine-tuning or loading)."""
    from .generate import DecodeSettings

    if args.predict_limit is not None and args.predict_limit < 1:
        raise ValueError(f"--predict-limit={args.predict_limit} is not allowed; it must be a positive integer")
    decode = DecodeSettings(args.max_new_tokens, args.top_k, args.predict_batch_size, args.seed)
    decode.check()
    return decode


def _warn_if_training_rows(task: str, record: dict, data, split: str) -> None:
    """A warning when the rows to predict are the fine-tuning run's own training rows."""
    from .data import resolve_file

    trained_on = record.get("identity", {}).get("data")
    same = split == "train" and trained_on == data
    if not same and data is not None and trained_on is not None:
        try:
            same = resolve_file(trained_on, "train").resolve() == resolve_file(data, split).resolve()
        except ValueError:  # the training data is not there any more: nothing to compare
            same = False
    if same:
        print(
            f"tapelm: warning: predicting '{task}' on the rows this model was fine-tuned on; its scores say "
            "nothing about held-out data",
            file=sys.stderr,
        )


def _predict_one(
    task: str,
    model: str,
    data,
    split: str,
    out: Path,
    decode,
    context=None,
    target_cap=None,
    limit=None,
    progress: bool = True,
) -> dict:
    from .data import check_split, load_examples, references
    from .generate import predict
    from .metrics import score
    from .models import SCROLLS_RUN_FILE, load_source
    from .prompting import PromptSettings, check_document_room

    check_split(split)
    spec = get_task(task)
    record_path = Path(model) / SCROLLS_RUN_FILE
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    if record and record.get("task") != task:
        raise ValueError(f"--model {model} was fine-tuned on '{record.get('task')}', not '{task}'")
    context = context or record.get("context")
    if context is None:
        raise ValueError("--context is required when --model is not a `tapelm scrolls finetune` run")
    prompts = PromptSettings(context, target_cap or record.get("target_cap"))
    if record:
        _warn_if_training_rows(task, record, data, split)
    examples = load_examples(task, split, data, limit)
    source = load_source(model, context)
    prompts.check(spec, source.codec)
    dropped = check_document_room(spec, source.codec, [example.input for example in examples], prompts)
    if dropped:
        print(
            f"tapelm: warning: {dropped} of {len(examples)} prompts keep no document token at context={context} "
            f"with target_cap={prompts.cap(spec)}",
            file=sys.stderr,
        )
    source.model.to(process_device())
    predictions = predict(source.model, source.codec, spec, examples, out, prompts, decode, progress=progress)
    result = {"predictions": str(out), "count": len(examples)}
    refs = references(examples)
    if all(refs.values()):
        result["scores"] = score(task, {i: predictions[i] for i in refs}, refs)
    return result


def _cli_predict(args) -> None:
    get_task(args.task)
    _check_source(args.model)
    for name in ("context", "target_cap", "predict_limit"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')}={value} is not allowed; it must be a positive integer")
    out = Path(args.out) if args.out else Path(args.model) / f"predictions-{args.split}.json"
    if out.is_dir():
        raise ValueError(f"--out '{out}' is a folder; give the predictions file to write")
    decode = _decode_settings(args)
    _threads(args)
    result = _predict_one(
        args.task,
        args.model,
        args.data,
        args.split,
        out,
        decode,
        args.context,
        args.target_cap,
        args.predict_limit,
        progress=not args.no_progress,
    )
    print(f"wrote {result['count']} predictions to {out}")
    if "scores" in result:
        print(json.dumps(result["scores"], indent=1))


def _cli_score(args) -> None:
    from .data import check_split, load_examples, references
    from .generate import read_predictions
    from .metrics import score

    get_task(args.task)
    check_split(args.split)
    if not Path(args.predictions).is_file():
        raise ValueError(
            f"--predictions '{args.predictions}' does not exist; give the JSON file written by "
            "`tapelm scrolls predict` (id -> text)"
        )
    predictions = read_predictions(args.predictions)
    refs = references(load_examples(args.task, args.split, args.data))
    scores = score(args.task, predictions, refs)
    text = json.dumps(scores, indent=1)
    if args.out:
        from ..training.atomic import write_json_atomically

        write_json_atomically(Path(args.out), scores)
    print(text)


def _cli_run(args) -> None:
    """finetune -> predict (validation) -> score, for one task or all seven. Every task is fine-tuned first (by every
    process of a launch); then the process group is left and the main process alone predicts and scores, so no
    process waits on a collective (and its timeout) while another generates."""
    from .data import check_split, resolve_file

    tasks = _tasks(args.task)
    check_split(args.split)
    if args.split == "train":
        raise ValueError(
            "--split train is not allowed for `scrolls run`: it would score the model on the rows it is "
            "fine-tuned on; choose validation or test"
        )
    _check_source(args.model)
    _check_folder("--out", args.out)
    decode = _decode_settings(args)
    out = Path(args.out)
    specs = {task: _spec(args, task, out / task) for task in tasks}
    if args.data is not None:  # every task's files exist before the first one trains
        for task in tasks:
            data = args.data if len(tasks) == 1 else _task_data(args.data, task)
            train_file, eval_file = resolve_file(data, "train"), resolve_file(data, args.split)
            if train_file.resolve() == eval_file.resolve():
                raise ValueError(
                    f"--data '{data}' is one file for both splits: `scrolls run` would fine-tune on the "
                    f"rows it then scores; give a folder with train.jsonl and {args.split}.jsonl (the "
                    "SCROLLS release layout)"
                )
    _threads(args)
    from accelerate.state import PartialState

    from ..training.atomic import write_json_atomically
    from .finetune import finetune
    from .metrics import average_score

    for task, spec in specs.items():
        run_dir = out / task
        finetune(spec, run_dir, resume=(run_dir / "settings.json").exists(), progress=not args.no_progress)
    state = PartialState()
    if state.num_processes > 1:
        state.destroy_process_group()  # fine-tuning is done; generation needs no collective
    if not state.is_main_process:
        return
    all_scores = {}
    for task in tasks:
        run_dir = out / task
        result = _predict_one(
            task,
            str(run_dir),
            args.data if len(tasks) == 1 else _task_data(args.data, task),
            args.split,
            run_dir / f"predictions-{args.split}.json",
            decode,
            limit=args.predict_limit,
            progress=not args.no_progress,
        )
        if "scores" in result:
            write_json_atomically(run_dir / f"scores-{args.split}.json", result["scores"])
            all_scores[task] = result["scores"]
            print(f"{task}: {get_task(task).metric} {result['scores']['scrolls_score']:.2f}")
    if len(all_scores) > 1:
        summary = {
            "tasks": {t: s["scrolls_score"] for t, s in all_scores.items()},
            "average": average_score(all_scores),
        }
        write_json_atomically(out / f"scores-{args.split}.json", summary)
        print(json.dumps(summary, indent=1))


def _task_data(data, task: str):
    """--data for `run all`: a folder holding one sub-folder per task (None: the Hub)."""
    return None if data is None else str(Path(data) / task)


def _cli_laptop(args) -> None:
    from .laptop import LaptopPlan, run_laptop

    plan = LaptopPlan(
        root=Path(args.root),
        results=Path(args.results),
        markdown=None if args.no_markdown else Path(args.markdown),
        steps=args.steps,
        progress=not args.no_progress,
    )
    plan.check()
    if args.threads < 1:
        raise ValueError(f"--threads={args.threads} is not allowed; it must be a positive integer")
    torch.set_num_threads(args.threads)
    results = run_laptop(plan)
    for key, result in results.items():
        print(f"{key}: {result['metric']} {result['scores'][result['metric']]:.2f}")
    print(f"wrote {args.results}" + ("" if args.no_markdown else f" and the section in {args.markdown}"))


def add_commands(commands) -> None:
    """Register `tapelm scrolls ...` on the `tapelm` sub-command parser."""
    scrolls = commands.add_parser("scrolls", help="SCROLLS: fine-tune, generate and score long-document tasks")
    sub = scrolls.add_subparsers(dest="scrolls_command", required=True, metavar="STEP")
    names = ", ".join(TASKS)

    finetune = sub.add_parser("finetune", help="fine-tune a model on one SCROLLS task (tapelm's training loop)")
    _common(finetune, f"one of: {names}")
    _finetune_arguments(finetune)
    finetune.add_argument("--out", required=True, help="run folder")
    finetune.set_defaults(handler=_cli_finetune)

    predict = sub.add_parser("predict", help="generate predictions (JSON id -> text; resumable) and score them")
    _common(predict, f"one of: {', '.join(ALL_TASKS)}")
    predict.add_argument(
        "--model", required=True, help="a `tapelm scrolls finetune` run folder (or any source with --context)"
    )
    predict.add_argument("--out", help="predictions file (default: MODEL/predictions-SPLIT.json)")
    predict.add_argument("--context", type=int, help="default: the fine-tuning run's")
    predict.add_argument("--target-cap", type=int, help="default: the fine-tuning run's")
    predict.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    _decode_arguments(predict)
    predict.set_defaults(handler=_cli_predict)

    score = sub.add_parser("score", help="score predictions exactly as SCROLLS does")
    _common(score, f"one of: {', '.join(ALL_TASKS)}")
    score.add_argument("--predictions", required=True, help="JSON object id -> predicted text")
    score.add_argument("--split", default="validation", help="the split the predictions are for (default: %(default)s)")
    score.add_argument("--out", help="also write the scores to this JSON file")
    score.set_defaults(handler=_cli_score)

    run = sub.add_parser("run", help="fine-tune, predict a split (validation) and score: one task or all seven")
    _common(run, f"one of: {names}, or all (then --data is a folder with one sub-folder per task)")
    _finetune_arguments(run)
    _decode_arguments(run)
    run.add_argument("--out", required=True, help="folder of the runs (one sub-folder per task)")
    run.set_defaults(handler=_cli_run)

    laptop = sub.add_parser(
        "laptop",
        help="the toy end-to-end run on one CPU thread (toy tasks from the Python "
        "sources, NOT SCROLLS): table in docs/RESULTS.md",
    )
    laptop.add_argument("--root", default="runs", help="runs and data cache (default: %(default)s)")
    laptop.add_argument(
        "--results", default="docs/results/scrolls-laptop", help="JSON results folder (default: %(default)s)"
    )
    laptop.add_argument("--markdown", default="docs/RESULTS.md", help="markdown file to splice the section into")
    laptop.add_argument("--no-markdown", action="store_true", help="write the JSON files only")
    laptop.add_argument("--steps", type=int, default=200, help="fine-tuning steps per run (default: %(default)s)")
    laptop.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    laptop.add_argument("--no-progress", action="store_true", help="no progress bars")
    laptop.set_defaults(handler=_cli_laptop)


__all__ = ["add_commands"]
