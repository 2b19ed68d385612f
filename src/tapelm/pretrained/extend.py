"""Context extension (shared/TAPE.md §6-7 at laptop scale): a RoPE base model with a short pretrained window W is
extended to `factor` x W by every method with the same budget, and every result is measured at 1x, 2x, 4x and 8x W.

Rows: the zero-training rows ("base" as it is, "pi-zero" and "yarn-zero": the scalings without training) and the
trained ones ("tape": converted, exact at step 0, with LoRA; "tape-no-lora"; "lora"; "longlora": S²-Attn while
training with linear position interpolation, as LongLoRA extends Llama2; "theta": the RoPE
base raised by the NTK-aware rule theta * factor ** (d / (d - 2)); "pi"; "yarn"; "full": every weight, the upper
bound). Every trained row uses the same steps, tokens (`factor` x W per sequence), learning-rate schedule (constant
after warm-up, as the paper) and data order (a pure function of the seed); the seed also draws the new parameters.

Measured: perplexity per corpus and length (held-out files, `tapelm.pretrained.evaluation`, the paper's stride
where the length allows), passkey retrieval per length, trainable parameters, seconds per step, and the validation
perplexity at the target length while training (the curves that show whether the budget let the ranking settle).

Layout under `out`: base/ (the cpu-small base when no --base is given), runs/ROW/seedS (fine-tuning checkpoints),
results/ROW.json (zero-training rows) and results/ROW/seedS.json, plan.json (what every result belongs to).
Resumable: a result that exists is kept, a fine-tuning resumes from its checkpoint.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..analysis.statistics import format_difference, interval, paired_difference, verdict
from ..data.corpora import PYTHON_DOCS, STDLIB
from ..experiments.runs import RunOptions, RunSpec, resolve, run_task
from ..training.devices import process_device
from ..training.launchers import die_with_parent
from ..training.saved_models import load_saved_model
from .data import CORPORA, held_out_documents
from .evaluation import evaluate_model, perplexity
from .finetune import FinetuneSettings, finetune, pretrained_window, scaling_overrides
from .retrofit import EvalPlan, MethodsFailed

ZERO_TRAINING = ("base", "pi-zero", "yarn-zero")
TRAINED = ("tape", "tape-no-lora", "lora", "longlora", "theta", "pi", "yarn", "full")
ROWS = ZERO_TRAINING + TRAINED
MULTIPLIERS = (1, 2, 4, 8)  # evaluated lengths, in base windows
CLAIM_BASELINES = ("lora", "longlora", "theta")  # the paper's table

# The cpu-small base: a RoPE model tapelm trains on both corpora with a 128-token window (docs/RECIPES.md, "Context
# extension": the size and budget from the curves in docs/sweeps/extend-base).
BASE_WINDOW = 128
BASE_SPEC = RunSpec(
    task="text",
    pe="rope",
    task_options={
        "corpus": [STDLIB, PYTHON_DOCS],
        "tokenizer": "bpe",
        "bpe_vocab_size": 2048,
        "train_length": BASE_WINDOW,
        "eval_multipliers": list(MULTIPLIERS),
    },
    model_options={"hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 4, "num_key_value_heads": 4},
    train_options={"steps": 3000, "batch_size": 16, "lr": 1e-3, "eval_every": 500, "checkpoint_every": 250},
    eval_n=64,
)


@dataclass(frozen=True)
class Budget:
    """What every trained row shares."""

    steps: int = 400  # LoRA's validation curve at the target length flattened by step 300 (docs/RECIPES.md)
    batch_size: int = 4
    grad_accum: int = 1
    lr: float = 2e-4
    warmup: int = 10
    eval_every: int = 25
    checkpoint_every: int = 50
    train_tokens: int = 2_000_000


PRESETS = {
    "cpu-small": (Budget(), EvalPlan(documents=8, scored=512, trials=20)),
    # the paper's Llama2-7B recipe (TAPE.md §6): 1,000 steps of 64 x 8,192 tokens, lr 2e-5, 50 warm-up steps
    "paper": (
        Budget(
            steps=1000,
            batch_size=1,
            grad_accum=64,
            lr=2e-5,
            warmup=50,
            eval_every=100,
            checkpoint_every=50,
            train_tokens=200_000_000,
        ),
        EvalPlan(documents=8, scored=512, trials=20),
    ),
}


@dataclass(frozen=True)
class ExtendPlan:
    base: str  # a model folder, .gguf or registered source name
    out: Path
    window: int  # the base's pretrained window
    factor: int = 4
    rows: tuple[str, ...] = ROWS
    seeds: tuple[int, ...] = (0, 1, 2)
    budget: Budget = field(default_factory=Budget)
    eval_plan: EvalPlan = field(default_factory=EvalPlan)
    prose_corpus: str | None = None
    results: Path | None = None  # default: out/results

    @property
    def results_dir(self) -> Path:
        return self.results or self.out / "results"

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", tuple(dict.fromkeys(self.rows)))
        object.__setattr__(self, "seeds", tuple(dict.fromkeys(self.seeds)))
        unknown = [row for row in self.rows if row not in ROWS]
        if unknown or not self.rows:
            raise ValueError(f"rows {unknown or '[]'} are not allowed; choose from: {', '.join(ROWS)}")
        if not self.seeds or any(not isinstance(s, int) or s < 0 for s in self.seeds):
            raise ValueError(f"seeds={list(self.seeds)} are not allowed; give non-negative integers")
        for name in ("window", "factor"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (2 if name == "factor" else 8):
                raise ValueError(
                    f"{name}={value!r} is not allowed; it must be an integer >= {2 if name == 'factor' else 8}"
                )
        for row in self.rows:
            if row in TRAINED:
                self.settings(row, self.seeds[0])  # every recipe's own checks, now

    @property
    def target(self) -> int:
        return self.factor * self.window

    def settings(self, row: str, seed: int, theta: float = 1e4, head_dim: int = 64) -> FinetuneSettings:
        """The fine-tuning recipe of a trained row (the base's theta and head_dim set the theta row's base)."""
        budget = self.budget
        method = "tape" if row == "tape-no-lora" else row
        return FinetuneSettings(
            method=method,
            train_length=self.target,
            steps=budget.steps,
            batch_size=budget.batch_size,
            grad_accum=budget.grad_accum,
            lr=budget.lr,
            warmup=budget.warmup,
            seed=seed,
            lora=row not in ("tape-no-lora", "full"),
            theta=ntk_theta(theta, self.factor, head_dim),
            target_length=self.target,
            pretrained_length=self.window,
            train_tokens=budget.train_tokens,
            checkpoint_every=budget.checkpoint_every,
            eval_every=budget.eval_every,
            prose_corpus=self.prose_corpus,
            interpolate_positions=row == "longlora",
        )

    def record(self) -> dict[str, Any]:
        """What every result of this plan belongs to (compared with plan.json: another base or budget is refused)."""
        return {
            "base": self.base,
            "window": self.window,
            "factor": self.factor,
            "budget": asdict(self.budget),
            "eval_plan": asdict(self.eval_plan),
            "prose_corpus": self.prose_corpus,
        }


def ntk_theta(theta: float, factor: int, head_dim: int) -> float:
    """The NTK-aware RoPE base for extending by `factor` (bloc97 2023): theta * factor ** (d / (d - 2))."""
    return float(theta * factor ** (head_dim / (head_dim - 2)))


def base_window(base: str | None) -> int:
    """The pretrained window of `base` (None: the cpu-small base's), from its config."""
    if base is None:
        return BASE_WINDOW
    folder = Path(base).expanduser()
    if (folder / "config.json").is_file():
        from transformers import AutoConfig

        return pretrained_window(AutoConfig.from_pretrained(folder))
    from .sources import load_pretrained

    return pretrained_window(load_pretrained(base)[0].config)


def eval_plan_for(plan_template: EvalPlan, window: int, prose_corpus: str | None) -> EvalPlan:
    """The template's evaluation at 1x..8x the window (perplexity and passkey)."""
    lengths = tuple(m * window for m in MULTIPLIERS)
    return replace(plan_template, lengths=lengths, passkey_lengths=lengths, prose_corpus=prose_corpus)


# ------------------------------------------------------------------------------------------------------ the base


def train_base(out: Path, progress: bool = True) -> Path:
    """The cpu-small base (BASE_SPEC), trained or resumed under `out`/base/run and exported as a Llama checkpoint
    with its tokenizer and its real window (max_position_embeddings = 128) to `out`/base/llama."""
    from transformers import AutoTokenizer

    from ..conversion import save, to_llama
    from ..modeling import TapeForCausalLM

    run_dir, folder = out / "base" / "run", out / "base" / "llama"
    if (folder / "config.json").is_file():
        return folder
    run = resolve(BASE_SPEC)
    run_task(run, run_dir, RunOptions(progress), resume=True, command="tapelm extend (the cpu-small base)")
    model = load_saved_model(run_dir / "model", TapeForCausalLM)
    save(
        to_llama(model, max_position_embeddings=BASE_WINDOW),
        AutoTokenizer.from_pretrained(run_dir / "model"),
        folder.with_name("llama.tmp"),
    )
    folder.with_name("llama.tmp").replace(folder)
    return folder


# ------------------------------------------------------------------------------------------------ one result


def result_path(results_dir: Path, row: str, seed: int) -> Path:
    return results_dir / (f"{row}.json" if row in ZERO_TRAINING else f"{row}/seed{seed}.json")


def zero_training_model(source, row: str, plan: ExtendPlan):
    """The base in tapelm's RoPE skeleton, as it is or with a scaling to the target length (no training)."""
    from ..conversion import from_pretrained_llama

    overrides = None if row == "base" else scaling_overrides(row.removesuffix("-zero"), plan.target, plan.window)
    return from_pretrained_llama(source, pe_type="rope", rope_overrides=overrides)


class _Documents:
    """The held-out documents of both corpora, tokenized once per process."""

    def __init__(self, tokenizer, eval_plan: EvalPlan) -> None:
        need = max(eval_plan.lengths) + eval_plan.scored
        self.by_corpus = {
            c: [
                ids[:need]
                for _, ids in held_out_documents(tokenizer, c, need, eval_plan.documents, eval_plan.prose_corpus)
            ]
            for c in CORPORA
        }

    def validation_fn(self, length: int, scored: int):
        """evaluate_fn(model, step) of the training loop: perplexity at `length` on the first document of each
        corpus (the validation curve)."""

        def evaluate(model, step: int) -> dict[str, float]:
            return {
                f"ppl_{corpus}": perplexity(model, docs[:1], length, len(docs[0]) - scored, scored)["perplexity"]
                for corpus, docs in self.by_corpus.items()
            }

        return evaluate


def run_one(plan: ExtendPlan, row: str, seed: int, progress: bool = False, log=print) -> dict[str, Any]:
    """Fine-tune (a trained row) and evaluate one row for one seed; writes and returns its result."""
    from .sources import load_pretrained

    path = result_path(plan.results_dir, row, seed)
    if path.exists():
        return json.loads(path.read_text())
    started = time.perf_counter()
    source, tokenizer = load_pretrained(plan.base)
    documents = _Documents(tokenizer, plan.eval_plan)
    record: dict[str, Any] = {
        "row": row,
        "seed": None if row in ZERO_TRAINING else seed,
        "plan": plan.record(),
        "threads": torch.get_num_threads(),
    }
    if row in ZERO_TRAINING:
        model = zero_training_model(source, row, plan).to(process_device())
        record["trainable"] = {}
    else:
        head_dim = (
            getattr(source.config, "head_dim", None) or source.config.hidden_size // source.config.num_attention_heads
        )
        settings = plan.settings(row, seed, source.config.rope_parameters["rope_theta"], head_dim)
        run_dir = plan.out / "runs" / row / f"seed{seed}"
        outcome = finetune(
            source,
            tokenizer,
            settings,
            run_dir,
            resume=True,
            progress=progress,
            source_name=plan.base,
            evaluate_fn=documents.validation_fn(plan.target, plan.eval_plan.scored),
        )
        model = outcome.model
        record.update(
            settings=settings.to_dict(),
            trainable=outcome.trainable,
            train={"seconds_per_step": outcome.seconds_per_step, "curve": _curve(run_dir)},
        )
    record["eval"] = evaluate_model(
        model,
        tokenizer,
        documents.by_corpus,
        list(plan.eval_plan.lengths),
        list(plan.eval_plan.passkey_lengths),
        plan.eval_plan.scored,
        plan.eval_plan.trials,
        plan.eval_plan.seed,
        log=lambda line: log(f"{row} / seed {seed}:{line}"),
    )
    record["seconds_total"] = time.perf_counter() - started
    _write_json(path, record)
    return record


def _curve(run_dir: Path) -> list[dict[str, Any]]:
    """The validation evaluations the training loop logged: [{step, ppl_code, ppl_prose}]."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{"step": r["step"], **r["eval"]} for r in rows if "eval" in r]


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(payload, indent=1))
    temporary.replace(path)


# ------------------------------------------------------------------------------------------------ the experiment


def check_plan_folder(plan: ExtendPlan) -> None:
    """ValueError when `plan.out` or its results folder is a file, or the results are of another base, budget or
    evaluation (their plan.json, written by `run_extension` once every check passed, differs)."""
    for flag, folder in (("--out", plan.out), ("--results", plan.results_dir)):
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"{flag} '{folder}' is a file; give a folder")
    path = plan.results_dir / "plan.json"
    if path.exists():
        try:
            saved = json.loads(path.read_text())
        except json.JSONDecodeError:
            raise ValueError(f"'{path}' is unreadable; choose another --out") from None
        differ = sorted(k for k, v in plan.record().items() if json.loads(json.dumps(v)) != saved.get(k))
        if differ:
            raise ValueError(
                f"'{plan.results_dir}' holds an extension with other settings (different "
                f"{', '.join(differ)}); choose another --results (and --out)"
            )


def check_cached_result(plan: ExtendPlan, row: str, seed: int) -> None:
    """ValueError when a cached result of a trained row was fine-tuned with other settings than this code gives it
    (theta, derived from the base that plan.json fixes, is taken as recorded)."""
    path = result_path(plan.results_dir, row, seed)
    if row in ZERO_TRAINING or not path.exists():
        return
    recorded = json.loads(path.read_text()).get("settings", {})
    saved = {**FinetuneSettings(method=recorded["method"], lora=recorded.get("lora", True)).to_dict(), **recorded}
    expected = replace(plan.settings(row, seed), theta=saved["theta"]).to_dict()
    differ = sorted(k for k, v in expected.items() if saved.get(k) != v)
    if differ:
        raise ValueError(
            f"'{path}' was fine-tuned with other settings (different {', '.join(differ)}); move it away to redo it"
        )


def check_passkey_lengths(plan: ExtendPlan) -> None:
    """ValueError when a passkey length cannot hold a passkey document with the base's tokenizer."""
    from transformers import AutoTokenizer

    from ..data.passkey_text import KEY_HIGH
    from .evaluation import passkey_prompt
    from .sources import load_pretrained

    folder = Path(plan.base).expanduser()
    tokenizer = AutoTokenizer.from_pretrained(folder) if folder.is_dir() else load_pretrained(plan.base)[1]
    for length in plan.eval_plan.passkey_lengths:
        try:
            passkey_prompt(tokenizer, length, KEY_HIGH - 1, 0.5)
        except ValueError:
            raise ValueError(
                f"passkey length {length} cannot hold a passkey document with this tokenizer; "
                "extend a model with a longer window"
            ) from None


def _worker(plan: ExtendPlan, row: str, seed: int, threads: int) -> str:
    torch.set_num_threads(threads)
    started = time.perf_counter()
    run_one(plan, row, seed, log=lambda line: None)
    return f"{row} / seed {seed}: done in {time.perf_counter() - started:.0f} s"


def run_extension(plan: ExtendPlan, jobs: int = 1, progress: bool = True, log=print) -> dict[str, Any]:
    """Every (row, seed) of `plan`, `jobs` at a time in worker processes (one torch thread each when jobs > 1);
    returns the summary. MethodsFailed at the end when a row failed (the others are still done)."""
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"--jobs={jobs!r} is not allowed; it must be a positive integer")
    check_plan_folder(plan)
    tasks = [
        (row, plan.seeds[0] if row in ZERO_TRAINING else seed)
        for seed in plan.seeds
        for row in plan.rows
        if row in TRAINED or seed == plan.seeds[0]
    ]
    for row, seed in tasks:
        check_cached_result(plan, row, seed)
    pending = [(row, seed) for row, seed in tasks if not result_path(plan.results_dir, row, seed).exists()]
    if pending:
        check_passkey_lengths(plan)
    if not (plan.results_dir / "plan.json").exists():
        _write_json(plan.results_dir / "plan.json", plan.record())
    log(f"{len(tasks) - len(pending)} of {len(tasks)} results cached in {plan.results_dir}")
    failed = []
    if jobs == 1:
        for index, (row, seed) in enumerate(pending, 1):
            log(f"[{index}/{len(pending)}] {row} / seed {seed}")
            try:
                run_one(plan, row, seed, progress=progress, log=log)
            except Exception:  # one failing row must not stop an unattended run of the others
                log(f"{row} / seed {seed}: FAILED\n{traceback.format_exc()}")
                failed.append(f"{row}/seed{seed}")
    else:
        with ProcessPoolExecutor(
            jobs, mp_context=multiprocessing.get_context("spawn"), initializer=die_with_parent, initargs=(os.getpid(),)
        ) as pool:
            futures = {pool.submit(_worker, plan, row, seed, 1): (row, seed) for row, seed in pending}
            for future in as_completed(futures):
                row, seed = futures[future]
                try:
                    log(future.result())
                except Exception:
                    log(f"{row} / seed {seed}: FAILED\n{traceback.format_exc()}")
                    failed.append(f"{row}/seed{seed}")
    if failed:
        raise MethodsFailed(
            f"{len(failed)} of {len(tasks)} results failed ({', '.join(failed)}); see the "
            "tracebacks above; the others are done"
        )
    return summarize(plan.results_dir)


# ------------------------------------------------------------------------------------------------ the summary


def load_results(results_dir: Path) -> dict[str, dict[int | None, dict[str, Any]]]:
    """{row: {seed (None for a zero-training row): result}} of every result file under `results_dir`."""
    results: dict[str, dict[int | None, dict[str, Any]]] = {}
    for row in ROWS:
        single = results_dir / f"{row}.json"
        if single.is_file():
            results[row] = {None: json.loads(single.read_text())}
        files = sorted((results_dir / row).glob("seed*.json")) if (results_dir / row).is_dir() else []
        if files:
            results[row] = {int(f.stem[4:]): json.loads(f.read_text()) for f in files}
    return results


def _per_seed(by_seed: dict[int | None, dict[str, Any]], value, seeds: list[int]) -> dict[int, float]:
    """{seed: value(result)}; a zero-training row (one result) gives its value for every seed."""
    if None in by_seed:
        return {seed: value(by_seed[None]) for seed in seeds}
    return {seed: value(result) for seed, result in by_seed.items()}


def summarize(results_dir: str | Path) -> dict[str, Any]:
    """Means with 95% intervals per row, corpus and length, TAPE's paired differences (log perplexity, passkey
    accuracy) against every other row, and the two claims' verdicts."""
    results = load_results(Path(results_dir))
    if not results:
        return {"rows": {}}
    plan = next(iter(next(iter(results.values())).values()))["plan"]
    window, factor = plan["window"], plan["factor"]
    lengths = [str(m * window) for m in MULTIPLIERS]
    seeds = sorted({seed for by_seed in results.values() for seed in by_seed if seed is not None}) or [0]
    passkey_lengths = [n for n in lengths if str(n) in map(str, plan["eval_plan"]["passkey_lengths"])]
    rows: dict[str, Any] = {}
    for row, by_seed in results.items():
        first = next(iter(by_seed.values()))
        rows[row] = {
            "seeds": [] if None in by_seed else sorted(by_seed),
            "perplexity": {
                c: {
                    n: interval([r["eval"]["perplexity"][c][n]["perplexity"] for r in by_seed.values()])
                    for n in lengths
                }
                for c in CORPORA
            },
            "passkey": {
                n: interval([r["eval"]["passkey"][n]["accuracy"] for r in by_seed.values()]) for n in passkey_lengths
            },
            "trainable": sum(first.get("trainable", {}).values()),
            "seconds_per_step": interval([r["train"]["seconds_per_step"] for r in by_seed.values() if "train" in r]),
            "curve": _mean_curve(by_seed),
        }
    paired: dict[str, Any] = {}
    if "tape" in results:
        for row, by_seed in results.items():
            if row == "tape":
                continue
            paired[row] = {
                "log_perplexity": {
                    c: {
                        n: paired_difference(
                            _per_seed(results["tape"], _log_perplexity(c, n), seeds),
                            _per_seed(by_seed, _log_perplexity(c, n), seeds),
                        )
                        for n in lengths
                    }
                    for c in CORPORA
                },
                "passkey_beyond": paired_difference(
                    _per_seed(results["tape"], _passkey_beyond(passkey_lengths, window), seeds),
                    _per_seed(by_seed, _passkey_beyond(passkey_lengths, window), seeds),
                ),
            }
    summary = {
        "plan": plan,
        "window": window,
        "target": factor * window,
        "lengths": lengths,
        "passkey_lengths": passkey_lengths,
        "rows": rows,
        "paired": paired,
    }
    summary["claims"] = judge_claims(summary)
    return summary


def _log_perplexity(corpus: str, length: str):
    """A result's log perplexity on `corpus` at `length`."""
    return lambda r: math.log(r["eval"]["perplexity"][corpus][length]["perplexity"])


def _passkey_beyond(lengths: list[str], window: int):
    """A result's mean passkey accuracy over the lengths beyond the base window (nan when none was measured)."""
    beyond = [n for n in lengths if int(n) > window]
    return lambda r: sum(r["eval"]["passkey"][n]["accuracy"] for n in beyond) / len(beyond) if beyond else float("nan")


def _mean_curve(by_seed: dict[int | None, dict[str, Any]]) -> list[dict[str, float]]:
    """The validation curve averaged over seeds, step by step (steps every seed logged)."""
    curves = [r["train"]["curve"] for r in by_seed.values() if "train" in r and r["train"].get("curve")]
    if not curves:
        return []
    steps = sorted(set.intersection(*({point["step"] for point in curve} for curve in curves)))
    keys = [k for k in curves[0][0] if k != "step"]
    return [
        {
            "step": step,
            **{k: float(sum(next(p[k] for p in c if p["step"] == step) for c in curves) / len(curves)) for k in keys},
        }
        for step in steps
    ]


CLAIMS = (
    (
        "extension-perplexity",
        "Context extension (4x a short RoPE window): TAPE's perplexity is the lowest at every "
        "evaluated length (1x-8x the base window, both corpora), below LoRA, LongLoRA and theta scaling.",
    ),
    (
        "extension-passkey",
        "Context extension: TAPE retrieves the passkey beyond the base window better than LoRA, "
        "LongLoRA and theta scaling (mean accuracy over 2x-8x the base window).",
    ),
)


def judge_claims(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The two claims: confirmed when every paired difference is in TAPE's favour (95% interval excluding zero),
    refuted when one is against it, inconclusive otherwise (also with fewer than two seeds or a row missing)."""
    judged = []
    for name, statement in CLAIMS:
        lines, verdicts = [], []
        for baseline in CLAIM_BASELINES:
            pair = summary["paired"].get(baseline)
            if pair is None:
                lines.append(f"{baseline}: not run")
                verdicts.append("missing")
                continue
            if name == "extension-perplexity":
                for corpus in CORPORA:
                    for n in summary["lengths"]:
                        difference = pair["log_perplexity"][corpus][n]
                        result = verdict(difference, higher_is_better=False)
                        verdicts.append(result)
                        lines.append(
                            f"{baseline}, {corpus} {n}: TAPE / {baseline} perplexity "
                            f"{format_difference(difference, log_ratio=True)}: {result}"
                        )
            else:
                difference = pair["passkey_beyond"]
                result = verdict(difference)
                verdicts.append(result)
                lines.append(f"{baseline}: TAPE − {baseline} {format_difference(difference)} points: {result}")
        beyond = [n for n in summary["passkey_lengths"] if int(n) > summary["window"]]
        if name == "extension-passkey" and not beyond:
            lines, outcome = ["passkey retrieval beyond the base window was not measured"], "not run"
        elif name == "extension-passkey" and all(
            row["passkey"][n]["mean"] == 0 for row in summary["rows"].values() for n in beyond
        ):
            lines.append("no row retrieves a passkey beyond the base window: this design cannot show the claim")
            outcome = "inconclusive"
        elif verdicts and all(v == "better" for v in verdicts):
            outcome = "confirmed"
        elif any(v == "worse" for v in verdicts):
            outcome = "refuted"
        else:
            outcome = "inconclusive"
        judged.append({"name": name, "statement": statement, "verdict": outcome, "details": lines})
    return judged


# ------------------------------------------------------------------------------------------------ the report

SECTION, TITLE = "context-extension", "Context extension: a short-window RoPE base extended 4x by every method"
COMMAND = "tapelm extend --jobs 2 --results docs/results/extend"


def _cell(stats: dict[str, float], spec: str, scale: float = 1.0) -> str:
    if stats["n"] == 0:
        return "–"
    text = format(stats["mean"] * scale, spec)
    return text if stats["n"] < 2 else f"{text} ± {format(stats['half_width'] * scale, spec)}"


def write_figures(summary: dict[str, Any], figures: Path) -> list[str]:
    """Perplexity against length (one panel per corpus) and the validation curves; returns the file names."""
    from ..analysis.plots import curves

    figures.mkdir(parents=True, exist_ok=True)
    names, lengths = [], [int(n) for n in summary["lengths"]]
    for corpus in CORPORA:
        series = {
            row: (
                lengths,
                [stats["perplexity"][corpus][str(n)]["mean"] for n in lengths],
                [stats["perplexity"][corpus][str(n)]["std"] for n in lengths],
            )
            for row, stats in summary["rows"].items()
        }
        name = f"extend-perplexity-{corpus}.png"
        curves(
            series,
            figures / name,
            f"Held-out {corpus} perplexity, a {summary['window']}-token RoPE base "
            f"extended to {summary['target']} (mean ± std over seeds; dotted: base window)",
            "evaluation length (tokens)",
            "perplexity",
            edge=summary["window"],
        )
        names.append(name)
    for corpus in CORPORA:
        series = {
            row: ([p["step"] for p in stats["curve"]], [p[f"ppl_{corpus}"] for p in stats["curve"]], None)
            for row, stats in summary["rows"].items()
            if stats["curve"]
        }
        if series:
            name = f"extend-training-{corpus}.png"
            curves(
                series,
                figures / name,
                f"Validation {corpus} perplexity at {summary['target']} tokens while fine-tuning (mean over seeds)",
                "fine-tuning step",
                "perplexity",
            )
            names.append(name)
    return names


def results_section(results_dir: Path, figures: Path, figures_link: str) -> str | None:
    """The markdown of the section (tables, paired differences, claims, figures), or None without results."""
    summary = summarize(results_dir)
    if not summary["rows"]:
        return None
    plan, lengths, rows = summary["plan"], summary["lengths"], summary["rows"]
    budget = plan["budget"]
    seeds = sorted({s for row in rows.values() for s in row["seeds"]})
    head = " | ".join(f"{n} ({int(n) // summary['window']}x)" for n in lengths)
    lines = [
        f"Produced by `{COMMAND}` (resumable; one JSON per row and seed in `{results_dir.as_posix()}`). Base: "
        f"`{plan['base']}`, pretrained window {summary['window']} tokens, extended to {summary['target']}. "
        f"Every trained row: {budget['steps']} steps x {budget['batch_size'] * budget['grad_accum']} sequences "
        f"x {summary['target']} tokens, AdamW lr {budget['lr']} constant after {budget['warmup']} warm-up steps; "
        f"seeds {', '.join(map(str, seeds))} (data order and new parameters). Held-out files: "
        f"{plan['eval_plan']['documents']} per corpus, {plan['eval_plan']['scored']} tokens each scored at "
        "every length (stride min(256, L/2)). Mean ± 95% interval over seeds.",
        "",
    ]
    for corpus in CORPORA:
        lines += [
            f"**Perplexity, {corpus}** (lower is better)",
            "",
            f"| row | {head} |",
            "|---|" + "---|" * len(lengths),
        ]
        lines += [
            f"| {row} | " + " | ".join(_cell(stats["perplexity"][corpus][n], ".2f") for n in lengths) + " |"
            for row, stats in rows.items()
        ]
        lines.append("")
    lines += [
        f"**Passkey retrieval** ({plan['eval_plan']['trials']} trials per length, greedy, % correct)",
        "",
        f"| row | {head} | trainable parameters | s / step |",
        "|---|" + "---|" * (len(lengths) + 2),
    ]
    lines += [
        f"| {row} | "
        + " | ".join(_cell(stats["passkey"][n], ".0f", 100) if n in stats["passkey"] else "–" for n in lengths)
        + f" | {stats['trainable']:,} | {_cell(stats['seconds_per_step'], '.2f')} |"
        for row, stats in rows.items()
    ]
    if summary["paired"]:
        lines += [
            "",
            "**TAPE against each row**, paired by seed: perplexity ratio TAPE / row [95% interval] (below 1: "
            "TAPE is better)",
            "",
            "| row | " + " | ".join(f"{c} {n}" for c in CORPORA for n in lengths) + " |",
            "|---|" + "---|" * (len(CORPORA) * len(lengths)),
        ]
        for row, pair in summary["paired"].items():
            lines.append(
                f"| {row} | "
                + " | ".join(
                    format_difference(pair["log_perplexity"][c][n], log_ratio=True) for c in CORPORA for n in lengths
                )
                + " |"
            )
    for claim in summary["claims"]:
        lines += ["", f"**{claim['name']}**: {claim['statement']} **{claim['verdict']}**.", ""]
        lines += [f"- {line}" for line in claim["details"]]
    lines.append("")
    for name in write_figures(summary, figures):
        lines += [f"![{name}]({figures_link}/{name})", ""]
    reading = results_dir / "reading.md"
    if reading.exists():
        lines += [reading.read_text().strip(), ""]
    return "\n".join(lines)
