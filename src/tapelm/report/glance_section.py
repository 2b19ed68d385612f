"""The README's first screen: one figure with, for each task, TAPE minus every other encoding beyond the training
length with its 95% interval, marked TAPE ahead, behind or no difference shown; under it one line per task, TAPE
against RoPE, against the best other encoding, and the paper's claim. The rows and statistics are the findings'
(`findings_section.entries`), at each encoding's tuned rate where the task's comparison at tuned rates has run
every encoding and seed (its label says so: `HASH-tuned`); the long per-encoding lists stay in docs/RESULTS.md."""

from __future__ import annotations

import math
from typing import Any

from ..analysis import plots
from ..analysis.statistics import higher_is_better, verdict
from ..experiments import claims
from . import findings_section as findings
from .claims_section import tuned_summary
from .sections import ReportContext, register_readme_section

FIGURE = "tape-against-each.png"
OUTCOMES = {"better": "TAPE ahead", "worse": "TAPE behind"}


def _shown(difference: dict[str, float], perplexity: bool) -> tuple[float, float, float]:
    """(mean, low, high) with TAPE ahead to the right: points for accuracies; for perplexities, the ratio X / TAPE
    (the difference is of the logarithms, TAPE's minus X's)."""
    mean, half = difference["mean"], difference["half_width"]
    half = 0.0 if math.isnan(half) else half
    if perplexity:
        return math.exp(-mean), math.exp(-mean - half), math.exp(-mean + half)
    return mean * 100, (mean - half) * 100, (mean + half) * 100


def panel(summary: dict[str, Any]) -> dict[str, Any]:
    """One task's panel for `plots.forest_panels`: every other encoding that learned the task in distribution, best
    for TAPE first; the others named in the note."""
    perplexity = summary["metric"] == "perplexity"
    x_label = "X's perplexity / TAPE's, log scale" if perplexity else "TAPE − X, points"
    x_label += " (right: TAPE ahead)"
    title = findings.label(summary)
    if not findings.learned(summary, findings.SUBJECT):
        note = "TAPE did not learn the task in distribution"
        return {"title": title, "x_label": x_label, "ratio": perplexity, "rows": [], "note": note}
    rows, unlearned = [], []
    for pe in findings.encodings(summary):
        if not findings.learned(summary, pe):
            unlearned.append(findings.name(pe))
            continue
        difference = summary["paired"][pe]["longer"]
        outcome = verdict(difference, higher_is_better(summary["metric"]))
        rows.append((findings.name(pe), *_shown(difference, perplexity), OUTCOMES.get(outcome, outcome)))
    rows.sort(key=lambda row: -row[1])
    note = f"did not learn in distribution: {', '.join(unlearned)}" if unlearned else ""
    return {"title": title, "x_label": x_label, "ratio": perplexity, "rows": rows, "note": note}


def _best_other(summary: dict[str, Any]) -> str:
    best = findings.best_other(summary)
    if best is None:
        return "no other that learned it shares two seeds with TAPE"
    return f"{findings.name(best)} {findings.against(summary, best)}"


def table(entries) -> str:
    """One line per task: TAPE against RoPE, against the best other, and the paper's claim's verdict."""
    lines = [
        "| task (recipe) | TAPE − RoPE | TAPE − the best other | the paper's claim |",
        "|---|---|---|---|",
    ]
    for summary, claim, result in entries:
        cells = [
            findings.label(summary),
            findings.against(summary, findings.REFERENCE),
            _best_other(summary),
            f"**{result}**" if claim is not None and result is not None else "none made",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def at_best_rates(context: ReportContext, entries) -> list:
    """The findings' entries, each at tuned rates where its comparison at tuned rates has run every encoding and
    seed of the shared rate's (its claim judged there), else at the shared rate: a partial comparison at tuned
    rates would put fewer encodings and seeds on the first screen."""
    chosen = []
    for summary, claim, result in entries:
        tuned = tuned_summary(context, summary)
        if tuned is None or not _covers(tuned, summary):
            chosen.append((summary, claim, result))
        else:
            chosen.append((tuned, claim, claims.judge(claim, tuned)[0] if claim is not None else None))
    return chosen


def _covers(tuned: dict[str, Any], summary: dict[str, Any]) -> bool:
    """Whether the comparison at tuned rates holds every encoding of `summary` on at least its seeds."""
    return all(
        pe in tuned["rows"] and set(row["seeds"]) <= set(tuned["rows"][pe]["seeds"])
        for pe, row in summary["rows"].items()
    )


def build(context: ReportContext) -> str | None:
    found = at_best_rates(context, findings.entries(context))
    if not found:
        return None
    context.figures.mkdir(parents=True, exist_ok=True)
    plots.forest_panels(
        [panel(summary) for summary, _, _ in found],
        context.figures / FIGURE,
        "TAPE against each encoding beyond the training length (laptop scale, paired by seed, 95% intervals; "
        "at tuned rates where the recipe's hash ends in -tuned)",
    )
    return f"![TAPE against each encoding, per task]({context.readme_figures_link}/{FIGURE})\n\n{table(found)}"


register_readme_section("at-a-glance", build)

__all__ = ["build", "panel", "table"]
