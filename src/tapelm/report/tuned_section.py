"""The "At tuned learning rates" section of docs/RESULTS.md: for each task's findings comparison (HASH) that has a
comparison at tuned rates beside it (HASH-tuned, `tapelm compare TASK --tuned`), each encoding's rate, TAPE against
it at the shared rate and at the tuned rates, and which verdicts change — of the encodings, and of the paper's claim
on that comparison."""

from __future__ import annotations

from typing import Any

from ..analysis.statistics import format_difference, higher_is_better, verdict
from ..experiments import claims
from . import findings_section as findings
from .claims_section import tuned_summary, untuned
from .sections import ReportContext, register_section

INTRO = (
    "Each encoding trained at the peak learning rate `tapelm tune` chose for it on the recipe (the protocol in "
    "docs/RECIPES.md: the shared rate x1/3, x1 or x3, one step further at an edge, chosen on a validation set at "
    "the training length with tuning seeds the comparison does not use), on the comparison's seeds, data, steps "
    "and batch. TAPE − X beyond the training length, paired by seed with 95% intervals, at the shared rate and at "
    "the tuned rates (TAPE at its own); *changed* where the verdict differs."
)


def _cell(summary: dict[str, Any], pe: str) -> tuple[str, str]:
    """(TAPE − pe beyond the training length with its verdict, the verdict alone), or who did not learn."""
    if pe not in summary["rows"]:
        return "not run", "not run"
    unlearned = [p for p in (findings.SUBJECT, pe) if not findings.learned(summary, p)]
    if unlearned:
        text = f"{' and '.join(map(findings.name, unlearned))} did not learn"
        return text, text
    difference = summary["paired"][pe]["longer"]
    outcome = verdict(difference, higher_is_better(summary["metric"]))
    perplexity = summary["metric"] == "perplexity"
    return f"{format_difference(difference, perplexity)}{'' if perplexity else ' pts'}: {outcome}", outcome


def _rate(record: dict[str, Any], pe: str) -> str:
    rate, shared = record["rates"][pe], record["train"]["lr"]
    return f"{rate:.3g} (x{rate / shared:.3g})"


def subsection(summary: dict[str, Any], tuned: dict[str, Any], claim: claims.Claim | None, result: str | None) -> str:
    """One task: the table of encodings, then the claim's verdict at both."""
    record = tuned["record"]
    lines = [
        f"### {findings.label(summary)}, at tuned rates (`{tuned['settings_hash']}`)",
        "",
        f"TAPE's rate: {_rate(record, findings.SUBJECT)}." if findings.SUBJECT in record["rates"] else "TAPE: not run.",
        "",
        "| encoding | its rate (x shared) | TAPE − X, shared rate | TAPE − X, tuned rates | |",
        "|---|---|---|---|---|",
    ]
    for pe in findings.encodings(tuned):
        shared_text, shared_outcome = _cell(summary, pe)
        tuned_text, tuned_outcome = _cell(tuned, pe)
        compared = shared_outcome != tuned_outcome and "not run" not in (shared_outcome, tuned_outcome)
        changed = "*changed*" if compared else ""
        lines.append(f"| {findings.name(pe)} | {_rate(record, pe)} | {shared_text} | {tuned_text} | {changed} |")
    if claim is not None and result is not None and (missing := untuned(claim, tuned)):
        lines += [
            "",
            f"The paper's claim ({claim.name}): **{result}** at the shared rate; not judged at tuned rates until "
            f"{', '.join(missing)} are tuned and trained there.",
        ]
    elif claim is not None and result is not None:
        at_tuned, _ = claims.judge(claim, tuned)
        change = "changed" if at_tuned != result else "unchanged"
        lines += [
            "",
            f"The paper's claim ({claim.name}): **{result}** at the shared rate, **{at_tuned}** at tuned rates "
            f"({change}).",
        ]
    return "\n".join(lines)


def build(context: ReportContext) -> str | None:
    parts = []
    for summary, claim, result in findings.entries(context):
        tuned = tuned_summary(context, summary)
        if tuned is not None:
            parts.append(subsection(summary, tuned, claim, result))
    return "\n\n".join([INTRO, *parts]) if parts else None


register_section("tuned-rates", "At tuned learning rates", build)

__all__ = ["build", "subsection", "tuned_summary"]
