"""The report section of `tapelm compare` results: one subsection per comparison found under ROOT/compare, with its
settings, the exact commands, the table, the figures and a reading generated from the numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..analysis.statistics import higher_is_better, verdict
from ..experiments import archive, claims, plan
from ..experiments.tasks import TASKS
from ..variants import ABLATIONS, VARIANTS
from .sections import ReportContext, register_section

TASK_ORDER = ("addition", "passkey", "mqar", "flipflop", "text")
PAPER_ADDITION = {"rope": 26.32, "randpe": 26.56, "nope": 22.45, "fire": 26.98, "tape": 32.82}


def _comparisons(folder: Path) -> list[Path]:
    found = archive.archived_comparisons(folder)
    rank = {task: i for i, task in enumerate(TASK_ORDER)}
    return sorted(found, key=lambda p: (rank.get(p.parent.name, len(rank)), p.parent.name, p.name))


def build(context: ReportContext) -> str | None:
    from ..experiments import compare

    parts = []
    for directory in _comparisons(context.comparisons):
        context.figures.mkdir(parents=True, exist_ok=True)
        for stale in context.figures.glob(f"{directory.name}-*"):
            stale.unlink()
        everything = compare.load_results(directory)
        for group, names in _row_groups(list(everything)):
            summary = compare.aggregate(directory, write=False, only=names)
            results = {pe: by_seed for pe, by_seed in everything.items() if pe in names}
            prefix = f"{summary['settings_hash']}-{group + '-' if group else ''}"
            figures = compare.write_figures(summary, results, context.figures, prefix=prefix)
            (context.figures / f"{prefix}{summary['task']}-summary.json").write_text(
                json.dumps({k: v for k, v in summary.items() if k != "table"}, indent=1)
            )
            parts.append(_subsection(summary, results, figures, context, group))
    if not parts:
        return None
    return INTRO + "\n\n" + "\n\n".join(parts)


def _row_groups(names: list[str]) -> list[tuple[str, list[str]]]:
    """A comparison's rows as report subsections: the encodings, then (when it holds TAPE's ablation variants) the
    ablation table, full TAPE and RoPE (= TAPE without context) with the variants."""
    variants = [name for name in ABLATIONS if name in names and name in VARIANTS]
    encodings = [name for name in names if name not in VARIANTS]
    groups = [("", encodings)] if encodings else []
    if variants:
        groups.append(("ablation", [name for name in ABLATIONS if name in names]))
    return groups


INTRO = (
    "Models that differ only in their positional encoding, trained with identical budgets (same data stream per "
    "seed, same steps, batch, learning-rate schedule) and evaluated on the same held-out test data (evaluation "
    "seed fixed, so the spread across seeds is the training's). Every number below is read from the cached "
    "`result.json` / `eval.json` of `tapelm compare`; the figures and per-comparison `*-summary.json` files are in "
    "`docs/figures/`. *In-distribution* means what training drew from: lengths seen in training (addition: both "
    "operands within the training digits; flip-flop: the training length and ignore rate), *longer* the rest "
    "(for flip-flop also its sparse and dense splits at the training length); *all* is the mean over every "
    "evaluation condition (for addition the paper's heatmap average). Perplexities are averaged as "
    "log-perplexities."
)


def _settings_line(summary: dict[str, Any], results: dict) -> str:
    record = summary["record"]
    first = next(iter(next(iter(results.values())).values()))
    model = first["identity"]["model"]
    train = record["train"]
    env = first.get("environment", {})
    device = env.get("device", "cpu")
    seconds = [
        r.get("session_seconds") for by_seed in results.values() for r in by_seed.values() if r.get("session_seconds")
    ]
    timing = ""
    if seconds:
        where = "this machine, shared with other jobs" if device == "cpu" else device
        timing = f" Wall time per run (train + eval, {where}): {min(seconds) / 60:.1f}–{max(seconds) / 60:.1f} min."
    layers = model["num_hidden_layers"]
    matched = " (baselines widened to TAPE’s parameter count)" if record["match_params"] else ""
    return (
        f"Preset `{record['preset']}` (settings hash `{record['settings_hash']}`{_recipe_note(summary)}): {layers} "
        f"layer{'s' if layers > 1 else ''}, hidden {model['hidden_size']}, {model['num_attention_heads']} heads, MLP "
        f"{model['intermediate_size']}{matched}; "
        f"task options `{json.dumps(record['task_options'])}`; {train['steps']} steps × batch {train['batch_size']}"
        f"{' × ' + str(train['grad_accum']) if train['grad_accum'] > 1 else ''}, AdamW lr {train['lr']} "
        f"({train['warmup']} warm-up steps, {train['schedule']}), clip {train['clip']}, weight decay "
        f"{train['weight_decay']}; evaluation {record['eval']['n']} examples per condition"
        f"{' (spans of train_length tokens)' if summary['task'] == 'text' else ''}."
        f"{_corpus_note(summary['task'], record['task_options'])} "
        f"Commit `{env.get('commit', '?')[:10]}`, torch {env.get('torch', '?')}, "
        f"{env.get('cpu', '?') if device == 'cpu' else device}." + timing
    )


def _recipe_note(summary: dict[str, Any]) -> str:
    current = plan.superseded_by(summary["task"], summary["record"]["preset"], summary["record"]["settings_hash"])
    return f"; not the preset's current recipe, `{current}`" if current else ""


def _corpus_note(task: str, options: dict[str, Any]) -> str:
    if task != "text":
        return ""
    corpus = options.get("corpus") or "the *.py files of this Python's standard library (one file in 20 held out)"
    return f" Corpus: {corpus}, tokenizer {options.get('tokenizer', 'byte')}."


def _subsection(
    summary: dict[str, Any], results: dict, figures: list[str], context: ReportContext, group: str = ""
) -> str:
    task = summary["task"]
    # The encodings' table lists the commands that ran encodings only; the ablation table every command that ran
    # one of its rows (its TAPE and RoPE rows usually come from the encodings' comparison).
    commands = [
        c
        for c in summary["record"]["commands"]
        if set(c.split()) & set(summary["rows"]) and (group or not set(c.split()) & set(VARIANTS))
    ]
    title = f"{task} — {'ablation: ' if group else ''}{', '.join(summary['rows'])}"
    lines = [
        f"### {title}",
        "",
        _settings_line(summary, results),
        "",
        "Commands (run from the repository root; results are cached in `runs/`, so rerunning continues):",
        "",
        "```bash",
    ]
    lines += commands + ["tapelm report", "```", "", summary["table"], ""]
    if summary["missing"]:
        lines += [f"Not finished (no cached result yet): {', '.join(summary['missing'])}.", ""]
    for figure in figures:
        lines += [f"![{figure}]({context.figures_link}/{figure})", ""]
    lines += ["**Reading.**", ""] + [f"- {sentence}" for sentence in reading(summary)]
    return "\n".join(lines)


def _pct(value: float) -> str:
    return f"{value * 100:.1f}%"


def _value(stats: dict[str, float], metric: str) -> str:
    if metric == "perplexity":
        return f"{stats['mean']:.3f}"
    return _pct(stats["mean"])


def _late_trend(curves: dict[str, list]) -> str:
    """Where an encoding's learning curves stood over the last quarter of training: the mean over seeds of the
    quick evaluations at three quarters and at the end, and whether it was still rising (by more than 2 points);
    empty when the seeds' curves are not evaluated at the same steps."""
    steps = [[step for step, _ in points] for points in curves.values()]
    if not steps or any(s != steps[0] for s in steps) or len(steps[0]) < 2:
        return ""
    steps = steps[0]
    late = min(range(len(steps) - 1), key=lambda i: abs(steps[i] - 0.75 * steps[-1]))
    before, after = (sum(points[i][1] for points in curves.values()) / len(curves) for i in (late, -1))
    return (
        f"learning curves, mean over seeds: {_pct(before)} at step {steps[late]:,}, {_pct(after)} at "
        f"{steps[-1]:,}, {'still rising' if after - before > 0.02 else 'flat'}"
    )


def _seeds_learning(rows: dict[str, Any], floor: float) -> str:
    """How robust the recipe is: per encoding, the share of seeds that reach `floor` on their own and the lowest."""
    parts = []
    for pe, row in rows.items():
        reached, seeds = claims.seeds_reaching(row, floor)
        parts.append(f"{pe} {reached} of {seeds} (lowest {_pct(min(row['per_seed']['in_distribution'].values()))})")
    return f"Seeds that learn on their own (≥ {_pct(floor)} in distribution): " + ", ".join(parts) + "."


def _versus_tape(summary: dict[str, Any], unlearned: list[str]) -> list[str]:
    """TAPE against each baseline on the longer lengths, from the paired-by-seed intervals; a difference in either
    direction says little about length when one side (in `unlearned`) did not learn the task in distribution."""
    metric = summary["metric"]
    groups: dict[str, list[str]] = {}
    for pe, differences in summary.get("paired", {}).items():
        groups.setdefault(verdict(differences["longer"], higher_is_better(metric)), []).append(pe)
    measure, unchanged = ("ratio", "1") if metric == "perplexity" else ("difference", "zero")
    sentences = {
        "better": f"TAPE is ahead of {{}} on the longer lengths (the 95% interval of the paired {measure} "
        f"excludes {unchanged}).",
        "worse": f"TAPE is behind {{}} on the longer lengths (the 95% interval of the paired {measure} "
        f"excludes {unchanged}).",
        "no difference shown": f"On the longer lengths the paired 95% interval includes {unchanged} against "
        "{}: no difference shown at this number of seeds.",
        "too few seeds": "Against {} there are fewer than two shared seeds: no interval.",
    }
    out = []
    for name, pes in groups.items():
        out.append(sentences[name].format(", ".join(pes)))
        confounded = pes if "tape" in unlearned else [pe for pe in pes if pe in unlearned]
        if name in ("better", "worse") and confounded:
            out[-1] += (
                f" {'TAPE' if 'tape' in unlearned else ', '.join(confounded)} did not learn the task in "
                "distribution, so this gap mixes learning with length generalisation."
            )
    return out


def _ranking(rows: dict[str, Any], metric: str, label: str, higher: bool) -> str:
    values = {pe: row["longer"]["mean"] for pe, row in rows.items()}
    if len(set(values.values())) == 1:
        shown = _value(next(iter(rows.values()))["longer"], metric)
        return f"{label} longer than training: every encoding scores {shown}."
    ranked = sorted(rows, key=lambda pe: values[pe], reverse=higher)
    return (
        f"{label} longer than training, best first: "
        + ", ".join(f"{pe} {_value(rows[pe]['longer'], metric)}" for pe in ranked)
        + "."
    )


def reading(summary: dict[str, Any]) -> list[str]:
    """Sentences computed from the numbers: who learned the task, the ranking on longer inputs, TAPE against each
    baseline (a difference counts only when it exceeds the seed spread), and what this scale cannot show."""
    rows, metric, task = summary["rows"], summary["metric"], summary["task"]
    higher = metric != "perplexity"
    tokens = {pe: row["token_accuracy"] for pe, row in rows.items() if "token_accuracy" in row}
    out = []
    seeds = sorted({s for row in rows.values() for s in row["seeds"]})
    unlearned: list[str] = []
    if higher:
        floor = claims.learned_threshold(task)
        unlearned = [pe for pe, row in rows.items() if row["in_distribution"]["mean"] < floor]
        learned = [pe for pe in rows if pe not in unlearned]
        if learned:
            out.append(
                f"Learned in distribution (≥ {_pct(floor)} {metric.replace('_', ' ')}): "
                + ", ".join(f"{pe} {_value(rows[pe]['in_distribution'], metric)}" for pe in learned)
                + "."
            )
        if unlearned:
            trends = {pe: _late_trend(summary.get("learning_curves", {}).get(pe, {})) for pe in unlearned}
            out.append(
                f"Below {_pct(floor)} {metric.replace('_', ' ')} in distribution, i.e. the task is not "
                f"learned at this budget and exact-match length generalisation cannot show: "
                + ", ".join(f"{pe} ({trends[pe]})" if trends[pe] else pe for pe in unlearned)
                + "."
            )
        out.append(_seeds_learning(rows, floor))
        if tokens:
            chance = " (chance is about 10% per digit)" if task == "addition" else ""
            out.append(
                f"Token accuracy in distribution / on longer inputs{chance}: "
                + ", ".join(
                    f"{pe} {_pct(t['in_distribution']['mean'])} / {_pct(t['longer']['mean'])}"
                    for pe, t in tokens.items()
                )
                + "."
            )
    else:
        best = min(rows, key=lambda pe: rows[pe]["in_distribution"]["mean"])
        out.append(f"Lowest in-distribution perplexity: {best} ({_value(rows[best]['in_distribution'], metric)}).")
        blown = [pe for pe, row in rows.items() if row["longer"]["mean"] > 1.5 * row["in_distribution"]["mean"]]
        if blown:
            out.append(
                f"Perplexity grows by more than 1.5x beyond the training length for: {', '.join(blown)} "
                "(they do not extrapolate); the others stay within 1.5x."
            )
    out.append(_ranking(rows, metric, metric.replace("_", " ").capitalize(), higher))
    if tokens:
        out.append(_ranking(tokens, "accuracy", "Token accuracy", True))
    out += _versus_tape(summary, unlearned)
    out += TASKS[task].reading_notes(summary.get("record", {}).get("task_options", {}), bool(tokens))
    if "tape-non-equivariant" in summary.get("state_norms", {}):
        out.append(_stability(summary["state_norms"]))
    if task == "addition":
        shown = ", ".join(f"{pe} {v}" for pe, v in PAPER_ADDITION.items() if pe in rows)
        if shown:
            out.append(
                f"For scale: the paper's heatmap averages (train ≤ 40 digits, test ≤ 80, a much larger "
                f"model trained far longer) are {shown} (%). These runs are not a replication of that setting."
            )
    scale = (
        "the models are tiny and briefly trained ({} seed(s), a few minutes of CPU each)"
        if summary.get("record", {}).get("preset") != plan.GPU
        else "the models are the laptop's six times wider, "
        "trained with about 1,000x its compute ({} seed(s), minutes of a GPU each), still far from the paper's "
        "12 x 768 models trained for hours"
    )
    out.append(
        f"What this does not show: {scale.format(len(seeds))}, so differences in length generalisation here are "
        "weak evidence about the encodings at the paper's scale; a null result here is not evidence that TAPE does "
        "not help there. The test sets are small (see the settings line), so per-cell values in the figures are "
        "noisy."
    )
    return out


def _stability(state_norms: dict[str, dict[str, list]]) -> str:
    """The paper's instability claim (without orthogonal equivariance the positions diverge late in training), read
    from the norm of E leaving the last layer relative to E0."""
    parts = []
    for pe, found in state_norms.items():
        last = [norms[-1] for norms in found["norms"]]
        parts.append(f"{pe} {last[-1]:.3f} at step {found['steps'][-1]} (range {min(last):.3f}–{max(last):.3f})")
    return (
        "Norm of TAPE's positional state leaving the last layer, relative to E0, at the last in-training "
        "evaluation and its range over training: " + "; ".join(parts) + ". The paper reports that without "
        "orthogonal equivariance the positions become unstable late in training: that would show as a norm "
        "that keeps growing."
    )


register_section("task-comparison", "Task comparisons (`tapelm compare`)", build)

__all__ = ["build", "reading"]
