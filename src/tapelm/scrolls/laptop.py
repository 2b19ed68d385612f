"""The laptop end-to-end run: the SCROLLS pipeline (release-format files -> fine-tuning -> cached generation ->
SCROLLS' scoring) at toy size, on two small tasks built from real local text. They are NOT SCROLLS.

The text: the *.py files of this Python's standard library, found and split exactly as the `text` task finds and
splits them (sorted; file i is held out when i % 20 == 0), so the validation examples come from files the
pretrained text models never saw. Every function with a docstring whose first line is 10-48 ASCII characters
is a candidate; examples are drawn with a fixed seed.

- `stdlib_docstring_qa` (extractive QA, scored by SCROLLS' token F1): input = "Question: What is the first line of
  the docstring of NAME?" + a blank line + a window of the file's source that contains NAME's definition and the
  whole first docstring line (the window also holds the code around it); output = that line, a span of the window.
- `stdlib_docstring_summary` (summarisation, scored by SCROLLS' ROUGE geometric mean): input = the function's
  source with its docstring removed; output = the docstring's first line (the function's own one-line summary).

Models: the `text` models of the cpu-small preset (`tapelm train --task text --pe tape` and `--pe rope`: 4 layers,
hidden 128, byte-level, pretrained on 64-token windows), trained first if their runs are absent (cached in
ROOT/train). Each is fine-tuned per task at 4x its pretraining length (256 tokens), then generates for the held-out
examples (greedy for QA, top-k 3 sampling for the summary) and is scored. One JSON per (task, encoding) goes to the
results folder; `results_section` renders the table the report splices into docs/RESULTS.md.

What it can show: that every stage runs end to end at a context 4x the pretraining length, and the numbers of these
tiny models. What it cannot show: anything about SCROLLS or about TAPE against RoPE on long documents — the models
have about 0.8M parameters, see bytes, trained for minutes, and their scores are near the floor.
"""

from __future__ import annotations

import ast
import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..analysis.markdown import HEADER, splice
from ..data.corpora import VAL_EVERY, corpus_files
from ..training.atomic import write_json_atomically, write_text_atomically
from .data import load_examples, references
from .finetune import FinetuneSpec, finetune
from .generate import DecodeSettings, predict
from .metrics import score
from .prompting import PromptSettings
from .tasks import LAPTOP_TASKS, get_task

SECTION = "scrolls-laptop"
TITLE = "SCROLLS pipeline, laptop end-to-end run (toy tasks from the Python sources, not SCROLLS)"
COMMAND = "tapelm scrolls laptop"
QA_TASK, SUMMARY_TASK = "stdlib_docstring_qa", "stdlib_docstring_summary"
CAPS = {QA_TASK: 48, SUMMARY_TASK: 64}
QUESTION = "Question: What is the first line of the docstring of {name}?\n\n"
MIN_ANSWER, MAX_ANSWER = 10, 48
DATA_VERSION = 2


@dataclass(frozen=True)
class LaptopPlan:
    """Sizes of the laptop run. `root`: cache of runs and data; `results`: folder of the committed JSON files."""

    root: Path = Path("runs")
    results: Path = Path("docs/results/scrolls-laptop")
    markdown: Path | None = Path("docs/RESULTS.md")
    pes: tuple[str, ...] = ("tape", "rope")
    context_multiplier: int = 4
    train_examples: int = 2000
    validation_examples: int = 100
    steps: int = 200
    batch_size: int = 8
    lr: float = 1e-3
    warmup: int = 20
    predict_batch_size: int = 25
    seed: int = 0
    progress: bool = True

    def check(self) -> None:
        from ..positional import encoding_names

        for pe in self.pes:
            if pe not in encoding_names():
                raise ValueError(f"pe={pe!r} is not allowed; choose from: {', '.join(encoding_names())}")
        for name in (
            "context_multiplier",
            "train_examples",
            "validation_examples",
            "steps",
            "batch_size",
            "predict_batch_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed; it must be a positive integer")


# ------------------------------------------------------------------------------------------------------- the data


@dataclass(frozen=True)
class _Function:
    name: str
    lines: list[str]  # the file's lines (with line ends)
    first: int  # index of the def line (decorators excluded)
    last: int  # index of the function's last line
    doc_line: int  # index of the line holding the docstring's first line
    summary: str  # the docstring's first line
    doc_span: tuple[int, int]  # line indices of the docstring statement (inclusive)


def _functions(source: str) -> list[_Function]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node, clean=True)
        if not doc or not node.body or not isinstance(node.body[0], ast.Expr):
            continue
        summary = doc.strip().splitlines()[0].strip()
        if not (MIN_ANSWER <= len(summary) <= MAX_ANSWER and summary.isascii() and summary.isprintable()):
            continue
        statement = node.body[0]
        span = (statement.lineno - 1, statement.end_lineno - 1)
        doc_line = next((i for i in range(span[0], span[1] + 1) if summary in lines[i]), None)
        if doc_line is None or len(node.body) < 2 or span[0] <= node.lineno - 1:
            continue
        found.append(_Function(node.name, lines, node.lineno - 1, node.end_lineno - 1, doc_line, summary, span))
    return found


def _qa_input(function: _Function, budget: int, rng: np.random.Generator) -> str | None:
    """The question and a window of at most `budget` characters of source holding the def line and the answer."""
    question = QUESTION.format(name=function.name)
    room = budget - len(question)
    lines = function.lines
    needed = "".join(lines[function.first : function.doc_line + 1])
    if len(needed) > room or not needed.isascii():
        return None
    before = int(rng.integers(0, 6))
    start = function.first
    while (
        start > 0 and function.first - start < before and len("".join(lines[start - 1 : function.doc_line + 1])) <= room
    ):
        start -= 1
    window = "".join(lines[start:])[:room]
    if not window.isascii() or function.summary not in window:
        return None
    return question + window


def _summary_input(function: _Function) -> str | None:
    lines = function.lines
    body = lines[function.first : function.doc_span[0]] + lines[function.doc_span[1] + 1 : function.last + 1]
    text = "".join(body)
    return text if text.isascii() and text.strip() else None


def _candidates(files: list[Path]) -> list[tuple[Path, _Function]]:
    candidates = []
    for path in files:
        try:
            source = path.read_text("utf-8")
        except UnicodeDecodeError:
            continue
        candidates += [(path, function) for function in _functions(source)]
    return candidates


def _rows(
    candidates: list[tuple[Path, _Function]], task: str, count: int, seed: int, qa_budget: int
) -> list[dict[str, str]]:
    order = np.random.default_rng([seed, 0 if task == QA_TASK else 1]).permutation(len(candidates))
    rows, seen = [], set()
    for index in order:
        path, function = candidates[int(index)]
        key = f"{path.parent.name}/{path.name}:{function.name}:{function.first + 1}"
        if key in seen:
            continue
        rng = np.random.default_rng([seed, int(index)])
        text = _qa_input(function, qa_budget, rng) if task == QA_TASK else _summary_input(function)
        if text is None:
            continue
        seen.add(key)
        rows.append({"id": key, "pid": key + "_0", "input": text, "output": function.summary})
        if len(rows) == count:
            break
    return rows


def build_data(
    folder: str | Path, plan: LaptopPlan, pretrained_length: int, files: list[Path] | None = None
) -> dict[str, Any]:
    """Write both tasks' train.jsonl / validation.jsonl in the SCROLLS release format under `folder`/TASK
    (rebuilt only when its description changes); returns the description (counts, caps, sources). `files`: the
    sorted source files (default: the standard library's, as the text task finds them)."""
    folder = Path(folder)
    context = plan.context_multiplier * pretrained_length
    qa_budget = context - CAPS[QA_TASK] - 1
    files = list(corpus_files(None)) if files is None else sorted(files)
    train_files = [f for i, f in enumerate(files) if i % VAL_EVERY]
    held_out = files[::VAL_EVERY]
    description = {
        "version": DATA_VERSION,
        "context": context,
        "caps": CAPS,
        "seed": plan.seed,
        "train_examples": plan.train_examples,
        "validation_examples": plan.validation_examples,
        "corpus": "the *.py files of this Python's standard library (tapelm.experiments.tasks.text."
        "corpus_files(None)); validation from the held-out files (every 20th, sorted)",
        "python": platform.python_version(),
        "files": {"train": len(train_files), "validation": len(held_out)},
    }
    marker = folder / "description.json"
    if marker.exists() and json.loads(marker.read_text()).get("request") == description:
        return json.loads(marker.read_text())
    counts = {}
    candidates = {"train": _candidates(train_files), "validation": _candidates(held_out)}
    for task in LAPTOP_TASKS:
        (folder / task).mkdir(parents=True, exist_ok=True)
        for split, count in (("train", plan.train_examples), ("validation", plan.validation_examples)):
            rows = _rows(candidates[split], task, count, plan.seed, qa_budget)
            write_text_atomically(folder / task / f"{split}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
            counts[f"{task}/{split}"] = len(rows)
    record = {"request": description, **description, "counts": counts}
    write_json_atomically(marker, record)
    return record


# ------------------------------------------------------------------------------------------------------- the run


def _text_run(root: Path, pe: str, progress: bool) -> Path:
    """The cpu-small `text` run of `pe` (trained now if absent; resumed if unfinished)."""
    from ..experiments.runs import RunOptions, RunSpec, resolve, run_task

    run_dir = root / "train" / f"text-{pe}-seed0"
    if not (run_dir / "result.json").exists():
        run_task(resolve(RunSpec(task="text", pe=pe, seed=0)), run_dir, RunOptions(progress), resume=True)
    return run_dir


def run_laptop(plan: LaptopPlan = LaptopPlan()) -> dict[str, dict[str, Any]]:
    """The whole laptop run (see the module docstring); returns {f"{task}-{pe}": result}."""
    plan.check()
    started = time.time()
    root = Path(plan.root)
    sources = {pe: _text_run(root, pe, plan.progress) for pe in plan.pes}
    identity = json.loads((sources[plan.pes[0]] / "run.json").read_text())["identity"]
    pretrained_length = int(identity["task_options"]["train_length"])
    data = build_data(root / "scrolls-laptop" / "data", plan, pretrained_length)
    results = {}
    for task_name in LAPTOP_TASKS:
        task = get_task(task_name)
        folder = root / "scrolls-laptop" / "data" / task_name
        examples = load_examples(task_name, "validation", folder)
        for pe, source in sources.items():
            run_dir = root / "scrolls-laptop" / f"{task_name}-{pe}"
            spec = FinetuneSpec(
                source=str(source),
                task=task_name,
                data=str(folder),
                preset="cpu-small",
                context=data["context"],
                target_cap=CAPS[task_name],
                seed=plan.seed,
                train_options={
                    "steps": plan.steps,
                    "batch_size": plan.batch_size,
                    "lr": plan.lr,
                    "warmup": plan.warmup,
                },
            )
            tuned_at = time.time()
            record = finetune(spec, run_dir, resume=(run_dir / "settings.json").exists(), progress=plan.progress)
            tuned = time.time() - tuned_at
            from .models import load_source

            loaded = load_source(run_dir)
            prompts = PromptSettings(record["context"], record["target_cap"])
            predicted_at = time.time()
            predictions_path = Path(plan.results) / "predictions" / f"{task_name}-{pe}.json"
            predictions = predict(
                loaded.model,
                loaded.codec,
                task,
                examples,
                predictions_path,
                prompts,
                DecodeSettings(batch_size=plan.predict_batch_size, seed=plan.seed),
                progress=plan.progress,
            )
            scores = score(task_name, {e.id: predictions[e.id] for e in examples}, references(examples))
            result = {
                "task": task_name,
                "pe": pe,
                "scores": scores,
                "metric": task.metric,
                "source_run": str(source),
                "pretrained_length": pretrained_length,
                "context": record["context"],
                "target_cap": record["target_cap"],
                "train": record["identity"]["train"],
                "training_rows": record["training_rows"],
                "first_loss": record["first_loss"],
                "final_loss": record["final_loss"],
                "finetune_seconds": tuned,
                "predict_seconds": time.time() - predicted_at,
                "validation_examples": len(examples),
                "distinct_predictions": len({predictions[e.id] for e in examples}),
                "decoding": "greedy" if not task.is_summary else "top-k 3 sampling",
                "samples": [
                    {"id": e.id, "reference": e.outputs[0], "prediction": predictions[e.id]} for e in examples[:3]
                ],
                "parameters": sum(p.numel() for p in loaded.model.parameters()),
                "pretrain_seconds": json.loads((source / "result.json").read_text()).get("session_seconds"),
                "environment": _environment(),
                "data": {k: v for k, v in data.items() if k != "request"},
            }
            write_json_atomically(Path(plan.results) / f"{task_name}-{pe}.json", result)
            results[f"{task_name}-{pe}"] = result
    summary = {
        "command": COMMAND,
        "seconds": time.time() - started,
        "torch_threads": torch.get_num_threads(),
        "plan": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(plan).items()},
    }
    write_json_atomically(Path(plan.results) / "run.json", summary)
    if plan.markdown is not None:
        update_markdown(plan.markdown, plan.results)
    return results


def _environment() -> dict[str, Any]:
    from ..training.provenance import environment

    return environment()


# ------------------------------------------------------------------------------------------------------- the table


def load_results(results_dir: str | Path) -> dict[str, dict[str, Any]]:
    results_dir = Path(results_dir)
    return {p.stem: json.loads(p.read_text()) for p in sorted(results_dir.glob("*.json")) if p.stem != "run"}


def results_section(results_dir: str | Path) -> str | None:
    """The markdown of the laptop run's report section, from its JSON files (None when there are none)."""
    results = load_results(results_dir)
    if not results:
        return None
    run = Path(results_dir) / "run.json"
    run_info = json.loads(run.read_text()) if run.exists() else {}
    first = next(iter(results.values()))
    data, train = first["data"], first["train"]
    pes = sorted(dict.fromkeys(r["pe"] for r in results.values()), key=lambda pe: (pe != "tape", pe))
    lines = [
        f"Produced by `{COMMAND}` (one command; resumable; one JSON per task and encoding in "
        f"`{Path(results_dir).as_posix()}`, their predictions in `predictions/`)"
        + (
            f", {run_info['seconds'] / 60:.1f} min with {run_info['torch_threads']} torch thread(s)."
            if run_info.get("seconds")
            else "."
        ),
        "",
        "**What this is.** Two toy tasks in the SCROLLS release format, built from the Python standard library's "
        "sources (validation examples from files held out of the text models' pretraining): "
        f"`{QA_TASK}` asks for the first line of a named function's docstring in a window of source that contains "
        f"it (extractive QA, scored with SCROLLS' token F1), `{SUMMARY_TASK}` asks for that line given the function's "
        "code without its docstring (scored with SCROLLS' ROUGE geometric mean). **They are not SCROLLS**, and these "
        "numbers say nothing about the paper's SCROLLS table.",
        "",
        "Models: the cpu-small `text` models (`tapelm train --task text --pe tape|rope`, trained by the command "
        "when absent"
        + _pretraining(results, pes)
        + "; "
        + ", ".join(f"{pe} {_first_of(results, pe)['parameters']:,} parameters" for pe in pes)
        + f"; bytes as tokens, pretrained on {first['pretrained_length']}-token windows), "
        f"each fine-tuned per task at {first['context']} tokens ({first['context'] // first['pretrained_length']}x "
        f"the pretraining length) for {train['steps']} steps x batch {train['batch_size']} "
        f"({first['training_rows']} training rows), AdamW lr {train['lr']}, {train['warmup']} warm-up steps then "
        f"polynomial (linear) decay, loss on the target only; targets capped at {data['caps'][QA_TASK]} (QA) and "
        f"{data['caps'][SUMMARY_TASK]} (summary) bytes. Generation with the cache: greedy for QA, top-k 3 sampling "
        f"for the summary; {first['validation_examples']} held-out examples per task.",
        "",
        "| task | metric | " + " | ".join(pes) + " |",
        "|---|---|" + "---:|" * len(pes),
    ]
    for task in LAPTOP_TASKS:
        row = [results.get(f"{task}-{pe}") for pe in pes]
        if not any(row):
            continue
        metric = get_task(task).metric
        lines.append(
            f"| `{task}` | {metric} | " + " | ".join(f"{r['scores'][metric]:.2f}" if r else "–" for r in row) + " |"
        )
    rouge = [
        (task, pe)
        for task in LAPTOP_TASKS
        for pe in pes
        if f"{task}-{pe}" in results and "rouge/rouge1" in results[f"{task}-{pe}"]["scores"]
    ]
    if rouge:
        lines += [
            "",
            "ROUGE-1 / ROUGE-2 / ROUGE-L of the summary task: "
            + "; ".join(
                f"{pe} {s['rouge/rouge1']:.2f} / {s['rouge/rouge2']:.2f} / {s['rouge/rougeL']:.2f}"
                for task, pe in rouge
                for s in [results[f"{task}-{pe}"]["scores"]]
            )
            + ".",
        ]
        if not any("rouge/rougeLsum" in results[f"{t}-{p}"]["scores"] for t, p in rouge):
            lines[-1] += (
                " ROUGE-Lsum is not reported: nltk's punkt data was not installed on this machine "
                "(it is outside the geometric mean)."
            )
    lines += [
        "",
        "Training loss (first logged -> last) and time per run: "
        + "; ".join(
            f"{r['task'].replace('stdlib_docstring_', '')}/{r['pe']} {r['first_loss']:.3f} -> {r['final_loss']:.3f} "
            f"({r['finetune_seconds']:.0f} s fine-tuning, {r['predict_seconds']:.0f} s generating)"
            for r in results.values()
        )
        + ".",
    ]
    lines += ["", "Samples (reference => prediction):", ""]
    for key, result in results.items():
        sample = result["samples"][0]
        lines.append(f"- {key}: `{_inline(sample['reference'])}` => `{_inline(sample['prediction'])}`")
    lines += ["", "**Reading.** " + _reading(results, pes)]
    return "\n".join(lines)


def _first_of(results: dict[str, dict[str, Any]], pe: str) -> dict[str, Any]:
    return next(r for r in results.values() if r["pe"] == pe)


def _pretraining(results: dict[str, dict[str, Any]], pes: list[str]) -> str:
    seconds = {pe: _first_of(results, pe).get("pretrain_seconds") for pe in pes}
    if not all(seconds.values()):
        return ""
    return (
        " — their pretraining took "
        + ", ".join(f"{value / 60:.1f} min ({pe})" for pe, value in seconds.items())
        + " when they were trained, not counted above"
    )


def _inline(text: str) -> str:
    return text.replace("`", "'").replace("\n", "⏎")[:120]


def _reading(results: dict[str, dict[str, Any]], pes: list[str]) -> str:
    values = [r["scores"][r["metric"]] for r in results.values()]
    parts = [f"Every score here is between {min(values):.1f} and {max(values):.1f} out of 100."]
    distinct = [f"{key} {r['distinct_predictions']}" for key, r in results.items() if "distinct_predictions" in r]
    if distinct:
        parts.append(
            f"Distinct predictions among the {next(iter(results.values()))['validation_examples']} "
            f"examples: {', '.join(distinct)}; where that number is small the model writes one generic "
            "docstring opening for every input, and its score comes from the words that opening shares "
            "with the references, not from reading the document."
        )
    parts.append(
        "These are byte-level models of under a million parameters trained for minutes; a score near zero "
        "is what they are expected to get, and a difference between encodings at this size is not evidence "
        "about TAPE or RoPE on long documents (one seed, 100 examples per task, no interval). What the run "
        "does show is that the whole SCROLLS pipeline — release-format data, truncated prompts with the "
        "loss on the target only, fine-tuning at 4x the pretraining length through tapelm's training loop, "
        "cached batched generation, SCROLLS' metrics — runs end to end on one CPU thread. The paper's "
        "protocol on GPUs is `tapelm scrolls run all --preset paper` (docs/SCROLLS.md)."
    )
    return " ".join(parts)


def update_markdown(markdown: str | Path, results_dir: str | Path) -> None:
    """Splice this run's section into `markdown` (created with the report header when absent)."""
    content = results_section(results_dir)
    if content is None:
        return
    markdown = Path(markdown)
    document = markdown.read_text() if markdown.exists() else HEADER
    write_text_atomically(markdown, splice(document, SECTION, f"## {TITLE}\n\n{content}"))


__all__ = [
    "LaptopPlan",
    "run_laptop",
    "build_data",
    "results_section",
    "update_markdown",
    "SECTION",
    "TITLE",
    "CAPS",
    "QA_TASK",
    "SUMMARY_TASK",
]
