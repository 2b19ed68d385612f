"""The "Claims" section: each of the paper's claims that the laptop comparisons can test, the measured numbers, the
criterion and a verdict — confirmed, refuted or inconclusive — computed from the cached comparison results.

Criterion, for every claim: TAPE is compared with each baseline by the paired-by-seed difference of the claim's
headline number and its 95% t interval. A comparison only counts when both encodings learned the task in
distribution (the task's threshold below); otherwise that baseline is "not testable". The claim is *confirmed* when
TAPE is better than every named baseline (every interval excludes zero in TAPE's favour), *refuted* when TAPE is
worse than at least one (an interval excludes zero against it), and *inconclusive* otherwise (some interval includes
zero, or a baseline is missing or not testable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..experiments.evaluate import higher_is_better
from ..experiments.statistics import verdict
from .sections import ReportContext, register_section

# In-distribution accuracy an encoding must reach before its length generalisation says anything (issue 8).
LEARNED = {"addition": 0.95, "passkey": 0.95, "multikey": 0.95, "mqar": 0.95, "flipflop": 0.99}


@dataclass(frozen=True)
class Claim:
    name: str
    statement: str
    task: str
    headline: str  # in_distribution | longer | all
    baselines: tuple[str, ...]


CLAIMS = (
    Claim("arithmetic", "Addition: TAPE's heatmap average over the 2x operand-length grid is above RoPE, RandPE, NoPE "
          "and FIRE (paper: 32.82 vs 26.32 / 26.56 / 22.45 / 26.98 %).", "addition", "all",
          ("rope", "randpe", "nope", "fire")),
    Claim("retrieval-passkey", "Passkey retrieval: TAPE is ahead beyond the training length.", "passkey", "longer",
          ("rope", "randpe", "nope", "fire", "alibi")),
    Claim("retrieval-mqar", "Associative recall (MQAR): TAPE is ahead beyond the training length.", "mqar", "longer",
          ("rope", "randpe", "nope", "fire", "alibi")),
    Claim("lm-perplexity", "Language modelling: TAPE's perplexity is the lowest at the training length.", "text",
          "in_distribution", ("rope", "randpe", "nope", "fire", "alibi")),
    Claim("lm-extrapolation", "Language modelling: TAPE extrapolates best (lowest perplexity beyond the training "
          "length).", "text", "longer", ("rope", "randpe", "nope", "fire", "alibi")),
)


def _best_comparison(root: Path, task: str) -> dict[str, Any] | None:
    """The comparison of `task` with TAPE that has the most finished runs (ties: the newest)."""
    from ..experiments.compare import aggregate

    best, best_key = None, None
    for record in sorted((root / "compare" / task).glob("*/comparison.json"), key=lambda p: p.stat().st_mtime):
        summary = aggregate(record.parent, write=False)
        if "tape" not in summary["rows"]:
            continue
        key = sum(len(row["seeds"]) for row in summary["rows"].values())
        if best_key is None or key >= best_key:
            best, best_key = summary, key
    return best


def _learned(summary: dict[str, Any], pe: str) -> bool:
    threshold = LEARNED.get(summary["task"])
    return threshold is None or summary["rows"][pe]["in_distribution"]["mean"] >= threshold


def _difference_text(difference: dict[str, Any], metric: str) -> str:
    if metric == "perplexity":
        ratio = math.exp(difference["mean"])
        if difference["n"] < 2:
            return f"×{ratio:.3f}"
        low, high = (math.exp(difference["mean"] + s * difference["half_width"]) for s in (-1, 1))
        return f"×{ratio:.3f} [{low:.3f}, {high:.3f}]"
    text = f"{difference['mean'] * 100:+.1f} pts"
    return text if difference["n"] < 2 else text + f" ± {difference['half_width'] * 100:.1f}"


def judge(claim: Claim, summary: dict[str, Any] | None) -> tuple[str, list[str]]:
    """The verdict and one line per baseline."""
    if summary is None:
        return "not run", [f"no `tapelm compare {claim.task}` results with TAPE yet"]
    metric, rows = summary["metric"], summary["rows"]
    lines, outcomes = [], []
    if not _learned(summary, "tape"):
        return "inconclusive", [f"TAPE did not learn {claim.task} in distribution "
                                f"({rows['tape']['in_distribution']['mean'] * 100:.1f}% < "
                                f"{LEARNED[claim.task] * 100:.0f}%): nothing to compare"]
    for pe in claim.baselines:
        if pe not in rows:
            outcomes.append("missing")
            lines.append(f"{pe}: not in the comparison")
            continue
        if not _learned(summary, pe):
            outcomes.append("not testable")
            lines.append(f"{pe}: did not learn in distribution ({rows[pe]['in_distribution']['mean'] * 100:.1f}%), "
                         "not testable")
            continue
        difference = summary["paired"][pe][claim.headline]
        outcome = verdict(difference, higher_is_better(metric))
        outcomes.append(outcome)
        lines.append(f"TAPE − {pe}: {_difference_text(difference, metric)} over seeds "
                     f"{','.join(map(str, difference['seeds']))} → {outcome}")
    if "worse" in outcomes:
        return "refuted", lines
    if outcomes and all(o == "better" for o in outcomes):
        return "confirmed", lines
    return "inconclusive", lines


def build(context: ReportContext) -> str | None:
    judged = []
    for claim in CLAIMS:
        summary = _best_comparison(context.root, claim.task)
        judged.append((claim, summary, *judge(claim, summary)))
    if all(result == "not run" for _, _, result, _ in judged):
        return None
    doc = (__doc__ or "").split("\n\n", 1)[1].strip().replace("\n", " ")
    lines = [doc, "", "| claim | comparison | verdict |", "|---|---|---|"]
    for claim, summary, result, _ in judged:
        where = f"`{claim.task}` {summary['settings_hash']}" if summary else "–"
        lines.append(f"| {claim.statement} | {where} | **{result}** |")
    for claim, summary, result, details in judged:
        if summary is None:
            continue
        lines += ["", f"**{claim.name}** ({claim.headline.replace('_', '-')}, {summary['metric'].replace('_', ' ')}): "
                  f"**{result}**.", ""] + [f"- {line}" for line in details]
    return "\n".join(lines)


register_section("claims", "Claims: verdicts at laptop scale", build)

__all__ = ["CLAIMS", "Claim", "LEARNED", "build", "judge"]
