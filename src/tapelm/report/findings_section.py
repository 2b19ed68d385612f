"""The findings table of docs/RESULTS.md (the README shows its short form, `glance_section`): what the laptop
comparisons found, one row per task (and per design the paper makes a claim on, e.g. addition with index hints) —
TAPE against RoPE and against the best other encoding beyond the training length, how every other encoding stands
against TAPE there, and the paper's claim on that comparison.

Every number is read from the archived comparisons (docs/results/compare) with the statistics of the rest of the
report: the paired-by-seed differences of `compare.aggregate`, `statistics.verdict` and `format_difference`, the
learn criterion of `claims.learned`, and the claims' verdicts as `claims_section.judge_all` gives them to the
verdicts table. A row's comparison is the one its claim is judged on; a task without a claim gets the comparison at
its current recipe (else the one with the most finished runs), chosen by the same rule.
"""

from __future__ import annotations

from typing import Any

from ..analysis.statistics import format_difference, higher_is_better, paired_difference, verdict
from ..experiments import claims
from ..experiments.presets import DEFAULT_PRESET
from ..variants import VARIANTS, display_name
from .claims_section import archived_summaries, best_comparison, current_hash, judge_all
from .sections import ReportContext, register_section

SUBJECT, REFERENCE = "tape", "rope"
ORDER = ("mqar", "flipflop", "passkey", "text", "addition", "word_problem")  # MQAR first: the README's main job
TASKS = {"mqar": "MQAR", "flipflop": "flip-flop", "word_problem": "word problem"}
# Where a claim is judged when not beyond the training length.
HEADLINES = {"all": "on the average over every length", "in_distribution": "at the training length"}

INTRO = (
    "Laptop scale (the `cpu-small` preset: tiny models, minutes of CPU each), beyond the training length. TAPE: its "
    "mean over seeds. Differences paired by seed with 95% intervals: TAPE − X in points ± the half-width, for "
    "perplexity the ratio TAPE / X [low, high]; *better* / *worse* when the interval excludes 0 (a ratio: 1). The "
    "best other: the best beyond the training length of the encodings that learned the task in distribution. The "
    "paper's claim: its verdict in the table below, against the baselines named."
)


def name(pe: str) -> str:
    return display_name(pe)


def _names(pes: list[str]) -> str:
    return ", ".join(map(name, pes))


def learned(summary: dict[str, Any], pe: str) -> bool:
    return claims.learned(summary["task"], summary["metric"], summary["rows"][pe]["in_distribution"]["mean"])


def encodings(summary: dict[str, Any]) -> list[str]:
    """The comparison's encodings other than TAPE (TAPE's ablation variants are not encodings of their own)."""
    return [pe for pe in summary["rows"] if pe != SUBJECT and pe not in VARIANTS]


def against(summary: dict[str, Any], pe: str) -> str:
    """TAPE against `pe` beyond the training length: the paired difference (a ratio for perplexity) with its 95%
    interval, the number of seeds and the verdict; says who did not learn the task in distribution."""
    if pe not in summary["rows"]:
        return f"{name(pe)} not in this comparison"
    difference = summary["paired"][pe]["longer"]
    perplexity = summary["metric"] == "perplexity"
    unit = "" if perplexity else " pts"
    text = (
        f"{format_difference(difference, perplexity)}{unit} ({_seeds(difference['n'])}): "
        f"{verdict(difference, higher_is_better(summary['metric']))}"
    )
    unlearned = [p for p in (SUBJECT, pe) if not learned(summary, p)]
    if unlearned:
        text += f"; {' and '.join(map(name, unlearned))} did not learn it in distribution"
    return text


def _seeds(count: int) -> str:
    return f"{count} seed{'' if count == 1 else 's'}"


def best_other(summary: dict[str, Any]) -> str | None:
    """The encoding other than TAPE with the best mean beyond the training length among those that learned the task
    in distribution and share two seeds or more with TAPE, so that the difference has an interval (the first in the
    comparison's order on a tie); None when there is no such encoding."""
    paired = summary["paired"]
    candidates = [
        pe for pe in encodings(summary) if learned(summary, pe) and verdict(paired[pe]["longer"]) != "too few seeds"
    ]
    if not candidates:
        return None
    sign = 1 if higher_is_better(summary["metric"]) else -1
    return max(candidates, key=lambda pe: sign * summary["rows"][pe]["longer"]["mean"])


def _others(summary: dict[str, Any]) -> str:
    """Every other encoding beyond the training length: ahead of TAPE, behind it, no difference shown, or not
    learned in distribution (then not compared)."""
    if not learned(summary, SUBJECT):
        threshold = claims.learned_threshold(summary["task"])
        others = [pe for pe in encodings(summary) if learned(summary, pe)]
        return (
            f"TAPE did not learn the task ({summary['rows'][SUBJECT]['in_distribution']['mean'] * 100:.1f}% < "
            f"{threshold * 100:.0f}% in distribution); learned: {_names(others) or 'none'}"
        )
    groups: dict[str, list[str]] = {"ahead of TAPE": [], "behind": [], "no difference shown": [], "did not learn": []}
    labels = {"worse": "ahead of TAPE", "better": "behind"}
    for pe in encodings(summary):
        if not learned(summary, pe):
            groups["did not learn"].append(pe)
            continue
        outcome = verdict(summary["paired"][pe]["longer"], higher_is_better(summary["metric"]))
        groups.setdefault(labels.get(outcome, outcome), []).append(pe)
    return "; ".join(f"{label}: {_names(pes)}" for label, pes in groups.items() if pes) or "–"


def _outcome(summary: dict[str, Any], claim: claims.Claim, pe: str) -> str:
    """One baseline of a claim as `claims.judge` counts it: missing, not testable, or the paired verdict."""
    rows = summary["rows"]
    if pe not in rows:
        return "missing"
    if not learned(summary, pe):
        return "not testable"
    per_seed = rows[claim.subject]["per_seed"][claim.headline], rows[pe]["per_seed"][claim.headline]
    difference = paired_difference(*per_seed)
    return verdict(difference, higher_is_better(summary["metric"])) if difference["seeds"] else "missing"


def _claim_cell(summary: dict[str, Any], claim: claims.Claim | None, result: str | None) -> str:
    """The paper's claim on this comparison: its verdict, why, and the baselines it is judged against (the claim's,
    which may name more than the paper did, e.g. ALiBi)."""
    if claim is None or result is None:
        return "the paper makes none"
    where = f" {HEADLINES[claim.headline]}" if claim.headline in HEADLINES else ""
    if not learned(summary, claim.subject):
        return f"**{result}**{where}: TAPE did not learn the task"
    outcomes: dict[str, list[str]] = {}
    for pe in claim.baselines:
        outcomes.setdefault(_outcome(summary, claim, pe), []).append(pe)
    reasons = {
        "worse": "{} ahead of TAPE",
        "better": "TAPE ahead of {}",
        "no difference shown": "no difference shown against {}",
        "too few seeds": "too few seeds against {}",
        "not testable": "{} did not learn",
        "missing": "{} not run",
    }
    order = ["worse", "not testable"] if result == "refuted" else list(reasons)
    why = "; ".join(reasons[key].format(_names(outcomes[key])) for key in order if key in outcomes)
    return f"**{result}**{where}: {why} (against {_names(list(claim.baselines))})"


def label(summary: dict[str, Any]) -> str:
    task = summary["task"]
    design = summary["record"].get("task_options", {}).get("format", "plain")
    shown = TASKS.get(task, task) + (f", {design.replace('_', ' ')}" if design != "plain" else "")
    return f"{shown} ({summary['record']['train']['steps']:,} steps, `{summary['settings_hash']}`)"


def _tape(summary: dict[str, Any]) -> str:
    """TAPE's own mean beyond the training length, in the task's metric, and its number of seeds."""
    row, metric = summary["rows"][SUBJECT], summary["metric"]
    mean = row["longer"]["mean"]
    shown = f"perplexity {mean:.3f}" if metric == "perplexity" else f"{mean * 100:.1f}% {metric.replace('_', ' ')}"
    return f"{shown} ({_seeds(len(row['seeds']))})"


def findings_row(summary: dict[str, Any], claim: claims.Claim | None = None, result: str | None = None) -> str:
    """One comparison's row of the findings table."""
    best = best_other(summary)
    versus = (
        f"{name(best)} {against(summary, best)}"
        if best
        else "no other that learned the task shares two seeds with TAPE"
    )
    cells = [
        label(summary),
        _tape(summary),
        against(summary, REFERENCE),
        versus,
        _others(summary),
        _claim_cell(summary, claim, result),
    ]
    return "| " + " | ".join(cells) + " |"


def findings_table(entries: list[tuple[dict[str, Any], claims.Claim | None, str | None]]) -> str:
    """The findings: the criteria in brief, then one row per (comparison, the paper's claim on it or None)."""
    lines = [
        INTRO,
        "",
        "| task (recipe) | TAPE | TAPE − RoPE | TAPE − the best other | the others against TAPE | the paper's claim |",
        "|---|---|---|---|---|---|",
    ]
    return "\n".join(lines + [findings_row(*entry) for entry in entries])


def _is_ablation(claim: claims.Claim) -> bool:
    return claim.name.startswith("ablation-")


def entries(context: ReportContext) -> list[tuple[dict[str, Any], claims.Claim | None, str | None]]:
    """(comparison, claim, verdict) per row: each comparison that a claim of the paper other than an ablation is
    judged on at laptop scale, with that claim (the one beyond the training length where there are several); then,
    for each archived task no claim covers, the comparison the claims' rule would pick, with no claim."""
    rows: dict[tuple[str, str], tuple[dict[str, Any], claims.Claim | None, str | None]] = {}
    for claim, summary, result, _ in judge_all(context, DEFAULT_PRESET) or []:
        if summary is None or _is_ablation(claim) or SUBJECT not in summary["rows"]:
            continue
        key = summary["task"], summary["settings_hash"]
        if key not in rows or (claim.headline == "longer" and rows[key][1].headline != "longer"):
            rows[key] = summary, claim, result
    covered = {task for task, _ in rows}
    archived = (
        sorted(p.name for p in context.comparisons.iterdir() if p.is_dir()) if context.comparisons.is_dir() else []
    )
    for task in archived:
        if task in covered:
            continue
        summaries = [
            s for s in archived_summaries(context.comparisons, task) if s["record"]["preset"] == DEFAULT_PRESET
        ]
        anyone = claims.Claim(task, "", task, "longer", ())
        summary = best_comparison(summaries, anyone, current_hash(anyone, DEFAULT_PRESET))
        if summary is not None:
            rows[task, summary["settings_hash"]] = summary, None, None
    rank = {task: index for index, task in enumerate(ORDER)}
    return sorted(rows.values(), key=lambda entry: (rank.get(entry[0]["task"], len(rank)), entry[0]["task"]))


def build(context: ReportContext) -> str | None:
    found = entries(context)
    return findings_table(found) if found else None


register_section("findings", "What tapelm found, per task", build)

__all__ = [
    "against",
    "best_other",
    "build",
    "encodings",
    "entries",
    "findings_row",
    "findings_table",
    "label",
    "learned",
    "name",
]
