"""The paper's claims that the laptop comparisons can test, and their verdicts — confirmed, refuted or inconclusive —
computed from a comparison's summary (see `compare.aggregate`).

Criterion, for every claim: the claim's subject (TAPE, or for the layer ablation TAPE in the second half of the
layers) is compared with each baseline by the paired-by-seed difference of the claim's headline number (for a
perplexity, of its logarithm: the ratio's interval then excludes 1 where the difference's excludes zero) and its 95% t
interval. A comparison only counts when both learned the task in distribution (the task's threshold in `LEARNED`);
otherwise that baseline is "not testable". The claim is *confirmed* when the subject is better than every named
baseline (every interval excludes zero in its favour), *refuted* when it is worse than at least one (an interval
excludes zero against it), and *inconclusive* otherwise (some interval includes zero, or a baseline is missing or
not testable).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from ..analysis.statistics import format_difference, higher_is_better, paired_difference, verdict
from .tasks import TASKS

# In-distribution accuracy an encoding must reach before its length generalisation says anything (issue 8); tasks
# not named here use DEFAULT_LEARNED.
LEARNED = {"addition": 0.95, "passkey": 0.95, "multikey": 0.95, "mqar": 0.95, "flipflop": 0.99}
DEFAULT_LEARNED = 0.95


def learned_threshold(task: str) -> float:
    """The in-distribution accuracy at which `task` counts as learned."""
    return LEARNED.get(task, DEFAULT_LEARNED)


@dataclass(frozen=True)
class Claim:
    name: str
    statement: str
    task: str
    headline: str  # in_distribution | longer | all
    baselines: tuple[str, ...]
    subject: str = "tape"
    design: tuple[tuple[str, Any], ...] = ()  # task options the comparison must have (absent: the task's default)

    def fits(self, summary: dict[str, Any]) -> bool:
        """Whether `summary` is a comparison of this claim's task in this claim's design."""
        if summary["task"] != self.task:
            return False
        recorded = summary["record"].get("task_options", {})
        defaults = inspect.signature(TASKS[self.task].__init__).parameters
        return all(recorded.get(key, defaults[key].default) == value for key, value in self.design)


def _ablation_claims(task: str, design: tuple[tuple[str, Any], ...] = ()) -> tuple[Claim, ...]:
    """The paper's three ablation claims on one task."""
    return (
        Claim(
            f"ablation-context-{task}",
            f"Ablation ({task}): full TAPE beats TAPE without context (positions fixed at E0: RoPE).",
            task,
            "all",
            ("rope",),
            design=design,
        ),
        Claim(
            f"ablation-equivariance-{task}",
            f"Ablation ({task}): full TAPE beats TAPE without orthogonal "
            "equivariance (see the state-norm figure for the paper's instability claim).",
            task,
            "all",
            ("tape-non-equivariant",),
            design=design,
        ),
        Claim(
            f"ablation-layers-{task}",
            f"Ablation ({task}): TAPE in the second half of the layers beats TAPE in the first half.",
            task,
            "all",
            ("tape-first-half",),
            subject="tape-second-half",
            design=design,
        ),
    )


CLAIMS = (
    Claim(
        "arithmetic",
        "Addition: TAPE's heatmap average over the 2x operand-length grid is above RoPE, RandPE, NoPE "
        "and FIRE (paper: 32.82 vs 26.32 / 26.56 / 22.45 / 26.98 %).",
        "addition",
        "all",
        ("rope", "randpe", "nope", "fire"),
        design=(("format", "plain"),),
    ),
    Claim(
        "arithmetic-index-hints",
        "Addition with index hints (a marker of significance before every digit, Zhou et "
        "al. 2024): TAPE's heatmap average over the 2x operand-length grid is above RoPE, RandPE, NoPE and FIRE.",
        "addition",
        "all",
        ("rope", "randpe", "nope", "fire"),
        design=(("format", "index_hints"),),
    ),
    Claim(
        "retrieval-passkey",
        "Passkey retrieval: TAPE is ahead beyond the training length.",
        "passkey",
        "longer",
        ("rope", "randpe", "nope", "fire", "alibi"),
    ),
    Claim(
        "retrieval-mqar",
        "Associative recall (MQAR): TAPE is ahead beyond the training length.",
        "mqar",
        "longer",
        ("rope", "randpe", "nope", "fire", "alibi"),
    ),
    Claim(
        "lm-perplexity",
        "Language modelling: TAPE's perplexity is the lowest at the training length.",
        "text",
        "in_distribution",
        ("rope", "randpe", "nope", "fire", "alibi"),
    ),
    Claim(
        "lm-extrapolation",
        "Language modelling: TAPE extrapolates best (lowest perplexity beyond the training length).",
        "text",
        "longer",
        ("rope", "randpe", "nope", "fire", "alibi"),
    ),
    Claim(
        "state-tracking",
        "State tracking (word problem over a permutation group, exact match of every running "
        "product): TAPE is ahead beyond the training length.",
        "word_problem",
        "longer",
        ("rope", "nope", "fox", "path"),
    ),
    # On the index-hints design: in the plain format no run goes beyond the training length, so the heatmap average
    # of every run that learned is its in-distribution quarter of the grid and no ablation can differ (plan.py).
    *_ablation_claims("addition", design=(("format", "index_hints"),)),
    *_ablation_claims("passkey"),
)


def learned(task: str, metric: str, in_distribution: float) -> bool:
    """Whether an in-distribution number counts as `task` learned: perplexity has no threshold; accuracies must reach
    the task's."""
    return metric == "perplexity" or in_distribution >= learned_threshold(task)


def _learned(summary: dict[str, Any], pe: str) -> bool:
    return learned(summary["task"], summary["metric"], summary["rows"][pe]["in_distribution"]["mean"])


def seeds_reaching(row: dict[str, Any], threshold: float) -> tuple[int, int]:
    """(how many of one encoding's seeds reach `threshold` in distribution on their own, how many seeds it has)."""
    per_seed = row["per_seed"]["in_distribution"].values()
    return sum(value >= threshold for value in per_seed), len(per_seed)


def _unlearned_detail(summary: dict[str, Any], pe: str) -> str:
    """The mean in distribution against the threshold, and how many seeds reached it on their own."""
    threshold = learned_threshold(summary["task"])
    reached, seeds = seeds_reaching(summary["rows"][pe], threshold)
    return (
        f"{summary['rows'][pe]['in_distribution']['mean'] * 100:.1f}% < {threshold * 100:.0f}%; "
        f"{reached} of {seeds} seeds reach it"
    )


def judge(claim: Claim, summary: dict[str, Any] | None) -> tuple[str, list[str]]:
    """The verdict and one line per baseline."""
    if summary is None or claim.subject not in summary["rows"]:
        return "not run", [f"no `tapelm compare {claim.task}` results with {claim.subject} yet"]
    metric, rows, subject = summary["metric"], summary["rows"], claim.subject
    lines, outcomes = [], []
    if not _learned(summary, subject):
        return "inconclusive", [
            f"{subject} did not learn {claim.task} in distribution "
            f"({_unlearned_detail(summary, subject)}): nothing to compare"
        ]
    for pe in claim.baselines:
        if pe not in rows:
            outcomes.append("missing")
            lines.append(f"{pe}: not in the comparison")
            continue
        if not _learned(summary, pe):
            outcomes.append("not testable")
            lines.append(f"{pe}: did not learn in distribution ({_unlearned_detail(summary, pe)}), not testable")
            continue
        difference = paired_difference(rows[subject]["per_seed"][claim.headline], rows[pe]["per_seed"][claim.headline])
        if not difference["seeds"]:
            outcomes.append("missing")
            lines.append(f"{pe}: no seed in common with {subject}")
            continue
        outcome = verdict(difference, higher_is_better(metric))
        outcomes.append(outcome)
        operator, unit = (" / ", "") if metric == "perplexity" else (" − ", " pts")
        shown = format_difference(difference, metric == "perplexity")
        lines.append(
            f"{subject}{operator}{pe}: {shown}{unit} over seeds {','.join(map(str, difference['seeds']))} → {outcome}"
        )
    if "worse" in outcomes:
        return "refuted", lines
    if outcomes and all(o == "better" for o in outcomes):
        return "confirmed", lines
    return "inconclusive", lines


def verdict_lines(summary: dict[str, Any]) -> list[str]:
    """One line per claim about this comparison's task: the claim, its verdict and the criterion in brief."""
    lines = []
    for claim in CLAIMS:
        if claim.fits(summary) and claim.subject in summary["rows"]:
            result, details = judge(claim, summary)
            lines.append(f"Claim ({claim.name}): {claim.statement} Verdict: {result.upper()} ({'; '.join(details)}).")
    return lines


__all__ = [
    "CLAIMS",
    "Claim",
    "DEFAULT_LEARNED",
    "LEARNED",
    "judge",
    "learned",
    "learned_threshold",
    "seeds_reaching",
    "verdict_lines",
]
