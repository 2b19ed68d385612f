"""The pretrained-model commands: `tapelm convert` and `tapelm finetune`."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

from ..conversion import CONVERTIBLE_PE_TYPES, from_pretrained_llama, save
from .data import PROSE_OPTION
from .extend import ROWS as ROWS_HELP
from .finetune import METHODS, FinetuneSettings
from .retrofit import EvalPlan, MethodsFailed, RunPlan, run_all
from .sources import load_pretrained


def _cli_convert(args) -> None:
    options = {}
    if args.tape_block:
        options["tape_block"] = tuple(args.tape_block)
    if args.tape_attn_mixing:
        options["tape_attn_mixing"] = args.tape_attn_mixing
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, None: None}[args.dtype]
    source, tokenizer = load_pretrained(args.src)
    print(save(from_pretrained_llama(source, pe_type=args.pe_type, dtype=dtype, **options), tokenizer, args.dst))


def _add_convert(commands) -> None:
    convert_parser = commands.add_parser(
        "convert",
        help="convert a Llama/Mistral/Qwen2 checkpoint to TAPE (exact at step 0)",
        description="Convert a Llama-family checkpoint to a TapeForCausalLM and save it with save_pretrained; "
        "load it back with AutoModelForCausalLM after `import tapelm`.",
    )
    convert_parser.add_argument("src", help="a registered source name (smollm2-135m), a checkpoint folder or a .gguf")
    convert_parser.add_argument("dst", help="output folder")
    convert_parser.add_argument("--pe-type", choices=CONVERTIBLE_PE_TYPES, default="tape")
    convert_parser.add_argument("--tape-block", type=int, nargs=2, metavar=("L", "R"))
    convert_parser.add_argument("--tape-attn-mixing", choices=("heads", "per_head"))
    convert_parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: the source's")
    convert_parser.set_defaults(handler=_cli_convert)


def _settings_from_args(args, method: str) -> FinetuneSettings:
    return FinetuneSettings(
        method=method,
        train_length=args.train_length,
        steps=args.steps,
        lr=args.lr,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        warmup=args.warmup,
        seed=args.seed,
        lora=not args.no_lora and method != "full",
        train_embeddings=not args.no_embeddings,
        train_norms=not args.no_norms,
        theta=args.theta,
        target_length=args.target_length,
        pretrained_length=args.pretrained_length,
        prose_corpus=args.prose_corpus,
    )


def _cli_finetune(args: argparse.Namespace) -> int:
    """Exit status 1 when a method failed (the others are still done), 2 for bad input (before any work)."""
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads={args.threads} is not allowed; it must be a positive integer")
    if args.eval_documents is not None and args.eval_documents < 1:
        raise ValueError(f"--eval-documents={args.eval_documents} is not allowed; it must be a positive integer")
    if args.markdown and Path(args.markdown).is_dir():
        raise ValueError(f"--markdown '{args.markdown}' is a folder; give a markdown file")
    methods = list(METHODS) if args.method == "all" else [args.method]
    eval_plan = EvalPlan(prose_corpus=args.prose_corpus)
    if args.eval_lengths or args.passkey_lengths is not None or args.eval_documents:
        eval_plan = replace(
            eval_plan,
            lengths=tuple(args.eval_lengths or eval_plan.lengths),
            passkey_lengths=tuple(eval_plan.passkey_lengths if args.passkey_lengths is None else args.passkey_lengths),
            documents=args.eval_documents or eval_plan.documents,
        )
    plan = RunPlan(
        model=args.model,
        out=Path(args.out),
        results=Path(args.results) if args.results else None,
        settings={m: _settings_from_args(args, m) for m in methods},
        evaluate=not args.no_eval,
        baselines=args.method == "all",
        quick=args.quick,
        eval_plan=eval_plan,
    )
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        run_all(plan, markdown=Path(args.markdown) if args.markdown else None)
    except MethodsFailed as error:
        print(f"tapelm: error: {error}", file=sys.stderr)
        return 1
    return 0


def _add_finetune(commands) -> None:
    parser = commands.add_parser(
        "finetune",
        help="fine-tune a pretrained model with TAPE, LoRA, LongLoRA, theta scaling or PI, and evaluate",
        description="Convert a pretrained Llama-family model, fine-tune it parameter-efficiently on real text "
        "(Python standard library + python3.11-doc or --prose-corpus), evaluate perplexity and passkey retrieval "
        "against length. `--method all` also evaluates the original and converted models and writes the results "
        "table. Resumable: rerun the same command after an interruption.",
    )
    parser.add_argument(
        "--model", default="smollm2-135m", help="source name, checkpoint folder or .gguf (default: %(default)s)"
    )
    parser.add_argument("--method", choices=[*METHODS, "all"], required=True)
    parser.add_argument("--out", default="runs/finetune", help="run folder (default: %(default)s)")
    parser.add_argument("--results", help="folder for the per-model result JSON files (default: OUT/results)")
    parser.add_argument("--markdown", help="write/refresh the 'Pretrained model' section of this markdown file")
    parser.add_argument("--train-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--theta", type=float, default=1e6, help="RoPE base for --method theta")
    parser.add_argument(
        "--target-length", type=int, default=512, help="context PI and YaRN scale to (default: %(default)s)"
    )
    parser.add_argument(
        "--pretrained-length",
        type=int,
        help="pretrained window PI and YaRN scale from (default: the model's, read from its config: "
        "rope_parameters' original_max_position_embeddings, else max_position_embeddings)",
    )
    parser.add_argument("--no-lora", action="store_true", help="method tape: train TAPE without LoRA")
    parser.add_argument("--no-embeddings", action="store_true", help="do not train the embeddings")
    parser.add_argument("--no-norms", action="store_true", help="do not train the norms")
    parser.add_argument("--no-eval", action="store_true", help="train only")
    parser.add_argument("--quick", action="store_true", help="a tiny evaluation (smoke test of the pipeline)")
    parser.add_argument(
        "--eval-lengths", type=int, nargs="+", help="perplexity context lengths (default: 128 256 512 1024)"
    )
    parser.add_argument(
        "--passkey-lengths", type=int, nargs="*", help="passkey lengths (default: 256 512; none: no passkey)"
    )
    parser.add_argument("--eval-documents", type=int, help="held-out files per corpus for perplexity (default: 1)")
    parser.add_argument("--threads", type=int, help="torch threads (1 is fastest on a CPU shared with other jobs)")
    parser.add_argument(
        PROSE_OPTION,
        metavar="FOLDER",
        help="a folder (or glob) of text files to use as the prose "
        "corpus (default: Debian's python3.11-doc, fetched with "
        "apt-get)",
    )
    parser.set_defaults(handler=_cli_finetune)


def _cli_extend(args: argparse.Namespace) -> int:
    """Exit status 1 when a row failed (the others are still done), 2 for bad input (before any work)."""
    from .extend import (
        PRESETS,
        ROWS,
        ExtendPlan,
        base_window,
        check_plan_folder,
        eval_plan_for,
        run_extension,
        train_base,
    )

    for name in ("jobs", "threads", "eval_documents", "passkey_trials"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')}={value} is not allowed; it must be a positive integer")
    if args.preset == "paper" and args.base is None:
        raise ValueError(
            "--preset paper needs --base (a Llama-family checkpoint folder, .gguf or source name); "
            "only cpu-small trains its own base"
        )
    budget, eval_template = PRESETS[args.preset]
    budget = replace(
        budget,
        **{
            k: v
            for k in ("steps", "batch_size", "grad_accum", "lr", "warmup", "eval_every")
            if (v := getattr(args, k)) is not None
        },
    )
    eval_template = replace(
        eval_template,
        **{k: v for k, v in (("documents", args.eval_documents), ("trials", args.passkey_trials)) if v is not None},
    )
    out = Path(args.out)
    base = args.base or str(out / "base" / "llama")
    window = args.pretrained_length or base_window(args.base)
    eval_plan = eval_plan_for(eval_template, window, args.prose_corpus)
    if args.no_passkey:
        eval_plan = replace(eval_plan, passkey_lengths=())
    plan = ExtendPlan(
        base=base,
        out=out,
        window=window,
        factor=args.factor,
        rows=tuple(args.rows or ROWS),
        seeds=tuple(args.seeds),
        budget=budget,
        eval_plan=eval_plan,
        prose_corpus=args.prose_corpus,
        results=Path(args.results) if args.results else None,
    )
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    check_plan_folder(plan)
    if args.base is None:
        train_base(out, progress=not args.no_progress)
    try:
        summary = run_extension(plan, jobs=args.jobs, progress=not args.no_progress)
    except MethodsFailed as error:
        print(f"tapelm: error: {error}", file=sys.stderr)
        return 1
    for claim in summary.get("claims", []):
        print(f"{claim['name']}: {claim['verdict']}")
    print(f"results: {plan.results_dir} (tapelm report writes the section and figures)")
    return 0


def _add_extend(commands) -> None:
    parser = commands.add_parser(
        "extend",
        help="extend a short-window RoPE model's context with TAPE and every peer method, and evaluate",
        description="Context extension (the paper's Proof-pile / PG-19 experiment at laptop scale): from one RoPE base "
        "(by default a 128-token-window model tapelm trains on the code and prose corpora), extend the "
        "context FACTOR x with TAPE (with and without LoRA), LoRA, LongLoRA, theta scaling, position "
        "interpolation, YaRN and a full fine-tune under the same budget, plus the zero-training rows; "
        "evaluate perplexity and passkey retrieval at 1x-8x the base window over several seeds. "
        "Resumable: rerun the same command after an interruption.",
    )
    parser.add_argument(
        "--base",
        help="a Llama-family checkpoint folder, .gguf or source name (default: the "
        "cpu-small base, trained into OUT/base on first use)",
    )
    parser.add_argument(
        "--preset",
        choices=("cpu-small", "paper"),
        default="cpu-small",
        help="budget and evaluation (paper: 1,000 steps of 64 x 8,192 tokens, lr 2e-5, for GPUs; needs --base)",
    )
    parser.add_argument("--rows", nargs="+", metavar="ROW", help="rows to run (default: all): " + ", ".join(ROWS_HELP))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--factor", type=int, default=4, help="extended context / base window (default: %(default)s)")
    parser.add_argument("--pretrained-length", type=int, help="the base's window (default: read from its config)")
    parser.add_argument("--out", default="runs/extend", help="run folder (default: %(default)s)")
    parser.add_argument("--results", help="folder for the result JSON files (default: OUT/results)")
    for name, kind in (
        ("steps", int),
        ("batch-size", int),
        ("grad-accum", int),
        ("lr", float),
        ("warmup", int),
        ("eval-every", int),
    ):
        parser.add_argument(
            f"--{name}", type=kind, help=f"fine-tuning {name.replace('-', ' ')} (default: the preset's)"
        )
    parser.add_argument("--eval-documents", type=int, help="held-out files per corpus (default: the preset's, 8)")
    parser.add_argument("--passkey-trials", type=int, help="passkey trials per length (default: the preset's, 20)")
    parser.add_argument("--no-passkey", action="store_true", help="measure perplexity only")
    parser.add_argument("--jobs", type=int, default=1, help="rows trained at once, one thread each (default: 1)")
    parser.add_argument("--threads", type=int, help="torch threads with --jobs 1")
    parser.add_argument(
        PROSE_OPTION,
        metavar="FOLDER",
        help="a folder (or glob) of text files to use as the prose corpus (default: Debian's python3.11-doc)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(handler=_cli_extend)


def add_commands(commands) -> None:
    """Register convert, finetune and extend on the `tapelm` sub-command parser `commands`."""
    _add_convert(commands)
    _add_finetune(commands)
    _add_extend(commands)
