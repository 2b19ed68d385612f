"""The retrofit experiment (shared/TAPE.md §6 at CPU scale): original, converted and every fine-tuned model,
evaluated alike, one JSON file per model, and the "Pretrained model" section of docs/RESULTS.md generated from them.

Resumable: a model whose JSON exists is skipped; a fine-tuning run resumes from its last checkpoint.

`tapelm report` section "pretrained-model" (registered in tapelm.report): built by `results_section`
from the committed JSON files in docs/results/pretrained (next to the report's figures folder). `update_markdown`
splices the same section into a markdown file directly, with the report's markers.
"""

from __future__ import annotations

import json
import platform
import subprocess
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..analysis.markdown import HEADER, splice
from ..data.passkey_text import KEY_HIGH
from ..training.devices import model_device, process_device
from .data import CORPORA, corpus_split, held_out_documents
from .evaluation import evaluate_model, passkey_prompt, stride_for
from .finetune import (
    METHODS,
    SCALED_METHODS,
    FinetuneSettings,
    check_run_folder,
    finetune,
    pretrained_window,
    scale_factor,
)

SECTION, TITLE = "pretrained-model", "Pretrained model: TAPE retrofitted into SmolLM2-135M"
ORDER = ("original", *METHODS, "converted")
MORE_SUFFIX = "-more"
COMMAND_MORE = (
    "tapelm finetune --model smollm2-135m --method all --pretrained-length 128 --threads 1 "
    "--out runs/retrofit --results docs/results/pretrained-more --eval-lengths 128 1024 --passkey-lengths "
    "--eval-documents 8"
)
BUDGET_FIELDS = ("train_length", "steps", "batch_size", "grad_accum", "lr", "warmup", "seed")
COMMAND = (
    "tapelm finetune --model smollm2-135m --method all --pretrained-length 128 --threads 1 "
    "--out runs/retrofit --results docs/results/pretrained --markdown docs/RESULTS.md"
)


@dataclass(frozen=True)
class EvalPlan:
    """What every model is evaluated on; `prose_corpus` as in `FinetuneSettings` (None: python3.11-doc)."""

    lengths: tuple[int, ...] = (128, 256, 512, 1024)
    passkey_lengths: tuple[int, ...] = (256, 512)
    scored: int = 256
    documents: int = 1
    trials: int = 20
    seed: int = 0
    prose_corpus: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", tuple(self.lengths))
        object.__setattr__(self, "passkey_lengths", tuple(self.passkey_lengths))
        for name, low in (("scored", 1), ("documents", 1), ("trials", 1), ("seed", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}={value!r} is not allowed; it must be an integer >= {low}")
        if not self.lengths or any(not isinstance(n, int) or isinstance(n, bool) or n < 2 for n in self.lengths):
            raise ValueError(f"eval lengths {list(self.lengths)} are not allowed; give one or more integers >= 2")
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in self.passkey_lengths):
            raise ValueError(f"passkey lengths {list(self.passkey_lengths)} are not allowed; give positive integers")
        for length in self.lengths:
            if self.scored % stride_for(length):
                raise ValueError(
                    f"eval length {length} is not allowed: its stride min(256, {length} // 2) = "
                    f"{stride_for(length)} must divide the {self.scored} scored tokens (e.g. lengths "
                    "that are powers of two)"
                )

    @classmethod
    def quick(cls, prose_corpus: str | None = None) -> EvalPlan:
        return cls(
            lengths=(64, 128), passkey_lengths=(128,), scored=64, documents=1, trials=2, prose_corpus=prose_corpus
        )


@dataclass
class RunPlan:
    model: str
    out: Path
    settings: dict[str, FinetuneSettings]
    results: Path | None = None
    evaluate: bool = True
    baselines: bool = True
    quick: bool = False
    eval_plan: EvalPlan = field(default_factory=EvalPlan)

    def results_dir(self) -> Path:
        return self.results or self.out / "results"


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except OSError:
        return ""


def _write(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)


class MethodsFailed(RuntimeError):
    """Raised by `run_all` after every other model is done when fine-tuning one or more methods failed."""


def _record_mismatch(record: dict, plan: RunPlan, name: str, eval_plan: EvalPlan) -> list[str]:
    """What of `plan` differs from the cached result `record` of model `name` (empty: the record is this plan's)."""
    differ = []
    if record.get("model") != plan.model:
        differ.append(f"source model {record.get('model')!r}, not {plan.model!r}")
    if name in plan.settings:
        try:
            same = FinetuneSettings(**record["settings"]) == plan.settings[name]
        except (KeyError, TypeError, ValueError):
            same = False
        if not same:
            differ.append("fine-tuning settings")
    if plan.evaluate and "eval" in record:
        try:
            same = EvalPlan(**record["eval_plan"]) == eval_plan
        except (KeyError, TypeError, ValueError):
            same = False
        if not same:
            differ.append("evaluation plan")
    return differ


def _reusable(record: dict, plan: RunPlan) -> bool:
    return not plan.evaluate or "eval" in record


def check_plan(plan: RunPlan, names: list[str], eval_plan: EvalPlan) -> dict[str, dict]:
    """Everything about `plan` that can be checked before loading a model: folders, corpora, and that every cached
    result and run folder is this plan's (same source model, settings and evaluation). Returns the reusable
    results by name; ValueError naming the problem otherwise."""
    for flag, folder in (("--out", plan.out), ("--results", plan.results_dir())):
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"{flag} '{folder}' is a file; give a folder")
    done = {}
    for name in names:
        path = plan.results_dir() / f"{name}.json"
        if not path.exists():
            continue
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError:
            raise ValueError(f"result file '{path}' is unreadable; move it away to redo {name}") from None
        differ = _record_mismatch(record, plan, name, eval_plan)
        if differ:
            raise ValueError(
                f"'{path}' holds results of another configuration (different {'; '.join(differ)}); "
                "choose another --results folder (and --out)"
            )
        if _reusable(record, plan):
            done[name] = record
    todo = [name for name in names if name not in done]
    for name in todo:
        if name in plan.settings:
            check_run_folder(plan.out / name, plan.settings[name], plan.model)
            check_scaling(plan.settings[name], plan.model)
    proses = {plan.settings[name].prose_corpus for name in todo if name in plan.settings}
    if plan.evaluate and todo:
        proses.add(eval_plan.prose_corpus)
    for prose in proses:
        corpus_split("prose", prose)
    return done


def check_scaling(settings: FinetuneSettings, model: str) -> None:
    """For a position scaling (pi, yarn) of a local checkpoint folder: ValueError now, before any model is loaded,
    when it would not extend the model's pretrained window (read from its config.json when not given)."""
    folder = Path(model).expanduser()
    if settings.method not in SCALED_METHODS or settings.pretrained_length or not (folder / "config.json").is_file():
        return
    from transformers import AutoConfig

    scale_factor(settings, pretrained_window(AutoConfig.from_pretrained(folder)))


def run_all(plan: RunPlan, markdown: Path | None = None, log=print) -> dict[str, dict]:
    """Evaluate the original and converted models (when `plan.baselines`) and fine-tune + evaluate every method of
    `plan.settings`, reusing the result JSON of a model when it is this plan's (`check_plan`). Returns {name: result};
    MethodsFailed at the end when a method failed (the others are still done)."""
    from ..conversion import from_pretrained_llama
    from .sources import load_pretrained

    eval_plan = EvalPlan.quick(plan.eval_plan.prose_corpus) if plan.quick else plan.eval_plan
    results_dir = plan.results_dir()
    names = [n for n in ORDER if n in plan.settings or (plan.baselines and n in ("original", "converted"))]
    done = check_plan(plan, names, eval_plan)
    if len(done) == len(names):
        for name in names:
            log(f"{name}: done before ({results_dir / f'{name}.json'})")
        return done
    source, tokenizer = load_pretrained(plan.model)
    source.to(process_device()).eval()
    documents, sample_prompt = None, None
    if plan.evaluate:
        for length in eval_plan.passkey_lengths:
            try:
                passkey_prompt(tokenizer, length, KEY_HIGH - 1, 0.5)
            except ValueError:
                raise ValueError(
                    f"passkey length {length} cannot hold a passkey document with this tokenizer; "
                    "give longer --passkey-lengths"
                ) from None
        need = max(eval_plan.lengths) + eval_plan.scored
        documents = {
            c: [
                ids[:need]
                for _, ids in held_out_documents(tokenizer, c, need, eval_plan.documents, eval_plan.prose_corpus)
            ]
            for c in CORPORA
        }
        sample_prompt = tokenizer.decode(documents["prose"][0][:48].tolist())
    failed = []
    for name in names:
        path = results_dir / f"{name}.json"
        if name in done:
            log(f"{name}: done before ({path})")
            continue
        started = time.perf_counter()
        record: dict = {
            "name": name,
            "model": plan.model,
            "commit": _commit(),
            "machine": platform.machine(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        }
        log(f"{name}: start")
        if name == "original":
            model = source
        elif name == "converted":
            model = from_pretrained_llama(source, pe_type="tape")
            record["max_abs_logit_diff_vs_original"] = _logit_diff(source, model, documents, tokenizer)
        else:
            settings = plan.settings[name]
            try:
                outcome = finetune(source, tokenizer, settings, plan.out / name, resume=True, source_name=plan.model)
            except Exception:  # one failing method must not stop an unattended run of the others
                log(f"{name}: FAILED\n{traceback.format_exc()}")
                failed.append(name)
                continue
            model = outcome.model
            record.update(
                settings=settings.to_dict(),
                trainable=outcome.trainable,
                train={
                    "steps_this_session": len(outcome.losses),
                    "seconds": outcome.seconds,
                    "seconds_per_step": outcome.seconds_per_step,
                    "losses": outcome.losses,
                    **_metrics(plan.out / name),
                },
            )
        if plan.evaluate:
            record["eval_plan"] = asdict(eval_plan)
            record["eval"] = evaluate_model(
                model,
                tokenizer,
                documents,
                list(eval_plan.lengths),
                list(eval_plan.passkey_lengths),
                eval_plan.scored,
                eval_plan.trials,
                eval_plan.seed,
                sample_prompt,
                log=lambda line, n=name: log(f"{n}:{line}"),
            )
        record["seconds_total"] = time.perf_counter() - started
        _write(path, record)
        done[name] = record
        log(f"{name}: done in {record['seconds_total']:.0f} s -> {path}")
        if markdown is not None:
            update_markdown(markdown, results_dir)
    if failed:
        raise MethodsFailed(
            f"{len(failed)} of {len(names)} models failed ({', '.join(failed)}); see the "
            "tracebacks above; the others are done"
        )
    return dict(sorted(done.items(), key=lambda item: names.index(item[0])))


def _metrics(run_dir: Path) -> dict:
    """Per-step losses logged by the training loop over the whole run (all sessions)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "loss" in r]
    return {"logged": [{"step": r["step"], "loss": r["loss"], "elapsed_s": r.get("elapsed_s")} for r in rows]}


@torch.no_grad()
def _logit_diff(source, converted, documents, tokenizer) -> float | None:
    if documents is None:
        return None
    ids = torch.from_numpy(documents["prose"][0][:512])[None].to(model_device(source))
    return (source(input_ids=ids).logits - converted(input_ids=ids).logits).abs().max().item()


# ------------------------------------------------------------------------------------------------------ the report


def _load(results_dir: Path) -> dict[str, dict]:
    return {
        name: json.loads((results_dir / f"{name}.json").read_text())
        for name in ORDER
        if (results_dir / f"{name}.json").exists()
    }


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _perplexity_table(results: dict[str, dict]) -> list[str]:
    plan = next(r for r in results.values() if "eval" in r)["eval_plan"]
    lengths = [str(x) for x in plan["lengths"]]
    lines = [
        f"Held-out files ({plan['documents']} per corpus, never trained on): the same {plan['scored']} tokens "
        f"per file, after its first {max(plan['lengths'])} tokens, scored with windows of each length L moved "
        "by min(256, L/2) (the paper's stride 256 where L allows).",
        "",
        "| model | " + " | ".join(f"{c} {n}" for c in CORPORA for n in lengths) + " |",
        "|" + "---|" * (1 + len(CORPORA) * len(lengths)),
    ]
    for name, record in results.items():
        if "eval" not in record:
            continue
        ppl = record["eval"]["perplexity"]
        cells = [_fmt(ppl.get(c, {}).get(n, {}).get("perplexity"), ".3f") for c in CORPORA for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def results_section(results_dir: str | Path) -> str:
    """The markdown of the "Pretrained model" section, from the result JSON files in `results_dir`."""
    results_dir = Path(results_dir)
    results = _load(results_dir)
    lines = [f"Produced by `{COMMAND}` (resumable; one JSON per model in `{results_dir.as_posix()}`).", ""]
    if not results:
        return "\n".join(lines + ["No results yet.", ""])
    any_eval = next((r for r in results.values() if "eval" in r), None)
    if any_eval is not None:
        plan = any_eval["eval_plan"]
        keys = [str(x) for x in plan["passkey_lengths"]]
        lines += ["### Perplexity against context length (lower is better)", "", *_perplexity_table(results)]
        more_dir = results_dir.parent / f"{results_dir.name}{MORE_SUFFIX}"
        more = _load(more_dir) if more_dir.is_dir() else {}
        if more:
            lines += [
                "",
                "### The same models on more held-out text",
                "",
                f"`{COMMAND_MORE}` (evaluation only: the finished runs are reloaded).",
                "",
                *_perplexity_table(more),
            ]
        lines += [
            "",
            f"### Passkey retrieval accuracy against length ({plan['trials']} trials each, greedy)",
            "",
            "| model | " + " | ".join(f"{n} tokens" for n in keys) + " |",
            "|" + "---|" * (1 + len(keys)),
        ]
        for name, record in results.items():
            if "eval" not in record:
                continue
            passkey = record["eval"]["passkey"]
            lines.append(
                f"| {name} | " + " | ".join(_fmt(passkey.get(n, {}).get("accuracy"), ".2f") for n in keys) + " |"
            )
    trained = {n: r for n, r in results.items() if "train" in r}
    if trained:
        first = next(iter(trained.values()))["settings"]
        budgets = {json.dumps({k: r["settings"][k] for k in BUDGET_FIELDS}) for r in trained.values()}
        tokens = first["steps"] * first["batch_size"] * first["grad_accum"] * first["train_length"]
        lines += [
            "",
            "### Training",
            "",
            f"Budget, {'identical for every method' if len(budgets) == 1 else 'NOT identical across methods'}:"
            f" {first['steps']} steps x {first['batch_size'] * first['grad_accum']} x {first['train_length']} "
            f"tokens = {tokens:,} tokens of training text, AdamW lr {first['lr']} (constant after "
            f"{first['warmup']} warm-up steps), no weight decay, clip 1.0; LoRA rank {first['lora_rank']}, "
            f"alpha {first['lora_alpha']} on q/k/v/o. theta: rope_theta {first['theta']:g}; pi: linear "
            f"factor {first['target_length']}/{first['pretrained_length']}; longlora: S²-Attn groups of "
            f"{int(first['train_length'] * first['s2_group_fraction'])} tokens while training.",
            "",
            "| method | trainable parameters | steps | s/step | training loss, first 10 steps | "
            "training loss, last 10 steps |",
            "|---|---|---|---|---|---|",
        ]
        for name, record in trained.items():
            groups = ", ".join(f"{k} {v:,}" for k, v in record["trainable"].items())
            losses = record["train"]["losses"]
            first = sum(losses[:10]) / len(losses[:10]) if losses else None
            last = sum(losses[-10:]) / len(losses[-10:]) if losses else None
            lines.append(
                f"| {name} | {groups} | {record['settings']['steps']} | "
                f"{record['train']['seconds_per_step']:.2f} | {_fmt(first, '.3f')} | {_fmt(last, '.3f')} |"
            )
    converted = results.get("converted", {}).get("max_abs_logit_diff_vs_original")
    if converted is not None:
        lines += ["", f"Converted (TAPE at step 0) vs original: max |Δ logit| = {converted:.2e} over 512 tokens."]
    samples = [(n, r["eval"]["sample"]) for n, r in results.items() if "sample" in r.get("eval", {})]
    if samples:
        lines += [
            "",
            "### Generation sample (greedy, 40 tokens)",
            "",
            "Prompt: `" + samples[0][1]["prompt"].replace("`", "'").replace("\n", "⏎") + "`",
            "",
        ]
        for name, sample in samples:
            lines.append(f"- **{name}**: `" + sample["continuation"].replace("`", "'").replace("\n", "⏎") + "`")
    missing = [n for n in ORDER if n not in results]
    if missing:
        lines += ["", f"Missing from this run: {', '.join(missing)}."]
    reading = results_dir / "reading.md"
    if reading.exists():
        lines += ["", reading.read_text().strip()]
    return "\n".join(lines) + "\n"


def update_markdown(path: str | Path, results_dir: str | Path) -> None:
    """Replace (or append) this section's marked block in the markdown file `path`."""
    path = Path(path)
    text = path.read_text() if path.exists() else HEADER
    text = splice(text, SECTION, f"## {TITLE}\n\n{results_section(results_dir)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
