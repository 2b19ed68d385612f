"""The "Claims" section of docs/RESULTS.md: every claim of `tapelm.experiments.claims` judged on the comparison of
its task at the default preset's recipe (where `tapelm compare TASK` writes), or, while that one lacks the claim's
subject, on the comparison of the task that has the most finished runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..experiments import claims
from ..experiments.compare import COMPARISON_FILE, aggregate
from ..experiments.plan import default_settings_hash
from .archive import archived_comparisons
from .extend_section import results_dir as extend_results
from .sections import ReportContext, register_section


def _best_comparison(summaries: list[dict[str, Any]], claim: claims.Claim, current_hash: str) -> dict[str, Any] | None:
    """Of one task's archived comparisons (oldest first) in the claim's design, the one at the current recipe's
    `current_hash` if it has the claim's subject, else the one with the subject that has the most finished runs
    (ties: the newest)."""
    best, best_key = None, None
    for summary in summaries:
        if claim.subject not in summary["rows"] or not claim.fits(summary):
            continue
        if summary["settings_hash"] == current_hash:
            return summary
        key = sum(len(row["seeds"]) for row in summary["rows"].values())
        if best_key is None or key >= best_key:
            best, best_key = summary, key
    return best


def _summaries(archive: Path, task: str) -> list[dict[str, Any]]:
    """The archived comparisons of `task`, aggregated, oldest first."""
    return [aggregate(directory, write=False) for directory in
            sorted(archived_comparisons(archive, task), key=lambda p: (p / COMPARISON_FILE).stat().st_mtime)]


def judge_all(context: ReportContext) -> list[tuple[claims.Claim, dict[str, Any] | None, str, list[str]]] | None:
    """Every claim with the comparison it is judged on, its verdict and one line per baseline; None when no claim
    has results."""
    judged, by_task = [], {}
    for claim in claims.CLAIMS:
        if claim.task not in by_task:
            by_task[claim.task] = (_summaries(context.comparisons, claim.task), default_settings_hash(claim.task))
        summaries, current_hash = by_task[claim.task]
        summary = _best_comparison(summaries, claim, current_hash)
        judged.append((claim, summary, *claims.judge(claim, summary)))
    if all(result == "not run" for _, _, result, _ in judged):
        return None
    return judged


def extension_claims(context: ReportContext) -> list[dict[str, Any]]:
    """The claims of `tapelm extend` judged on its committed results (none without results)."""
    from ..pretrained.extend import summarize

    return summarize(extend_results(context)).get("claims", [])


def build_verdicts(context: ReportContext) -> str | None:
    """The short table for the README: each claim and its verdict, linking to the evidence in docs/RESULTS.md."""
    judged, extension = judge_all(context), extension_claims(context)
    if judged is None and not extension:
        return None
    lines = ["| the paper's claim, tested at laptop scale | verdict |", "|---|---|"]
    lines += [f"| {claim.statement} | **{result}** |" for claim, _, result, _ in judged or []]
    lines += [f"| {claim['statement']} | **{claim['verdict']}** |" for claim in extension]
    return "\n".join(lines)


def build(context: ReportContext) -> str | None:
    judged, extension = judge_all(context), extension_claims(context)
    if judged is None and not extension:
        return None
    doc = (claims.__doc__ or "").split("\n\n", 1)[1].strip().replace("\n", " ")
    lines = [doc, "", "| claim | comparison | verdict |", "|---|---|---|"]
    for claim, summary, result, _ in judged or []:
        where = f"`{claim.task}` {summary['settings_hash']}" if summary else "–"
        lines.append(f"| {claim.statement} | {where} | **{result}** |")
    lines += [f"| {claim['statement']} | `tapelm extend` | **{claim['verdict']}** |" for claim in extension]
    for claim, summary, result, details in judged or []:
        if summary is None:
            continue
        lines += ["", f"**{claim.name}** ({claim.headline.replace('_', '-')}, {summary['metric'].replace('_', ' ')}): "
                  f"**{result}**.", ""] + [f"- {line}" for line in details]
    for claim in extension:
        lines += ["", f"**{claim['name']}**: **{claim['verdict']}** (section \"Context extension\").", ""]
        lines += [f"- {line}" for line in claim["details"]]
    return "\n".join(lines)


register_section("claims", "Claims: verdicts at laptop scale", build)

__all__ = ["build", "build_verdicts", "judge_all"]
