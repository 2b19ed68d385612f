"""The "Claims" section of docs/RESULTS.md: every claim of `tapelm.experiments.claims` judged at each scale — on
the laptop (the default preset) and on a GPU (`tapelm stage`, the `gpu` preset) — with the same criterion, on the
comparison of its task at that scale's current recipe (where `tapelm compare TASK` or the stage writes), or, while
that one lacks the claim's subject, on the comparison of the task at that scale that has the most finished runs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..experiments import archive, claims, compare, plan
from ..experiments.presets import DEFAULT_PRESET
from .extend_section import results_dir as extend_results
from .sections import ReportContext, register_section

SCALES = {"laptop": DEFAULT_PRESET, "GPU": plan.GPU}  # a scale's name and the preset its comparisons are run at


def best_comparison(
    summaries: list[dict[str, Any]], claim: claims.Claim, current_hash: str | None
) -> dict[str, Any] | None:
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


def _planned(claim: claims.Claim, preset: str) -> plan.OwedComparison | None:
    """The comparison `tapelm stage` plans at `preset` for the claim's task and design, if any."""
    return next(
        (
            owed
            for owed in plan.AT_GPU_SCALE
            if owed.preset == preset
            and owed.task == claim.task
            and claim.fits({"task": owed.task, "record": {"task_options": dict(owed.task_options)}})
        ),
        None,
    )


def current_hash(claim: claims.Claim, preset: str) -> str | None:
    """The settings hash of the comparison that decides `claim` at `preset`'s current recipe: the default preset's
    (`tapelm compare TASK`), or the one `tapelm stage` plans for the claim's task and design at GPU scale."""
    if preset == DEFAULT_PRESET:
        return plan.default_settings_hash(claim.task)
    planned = _planned(claim, preset)
    return planned.settings_hash() if planned else None


PAIR_ONLY = " (TAPE against RoPE only)"


def judge_at_scale(claim: claims.Claim, summary: dict[str, Any] | None, preset: str) -> tuple[str, list[str]]:
    """`claims.judge`, except at GPU scale while some baseline lacks the planned seeds and TAPE and RoPE have them
    all: the claim judged on that pair alone, its verdict labelled PAIR_ONLY (the stage decides the pairs first)."""
    planned = _planned(claim, preset) if preset != DEFAULT_PRESET else None
    if summary is None or planned is None or "rope" not in claim.baselines:
        return claims.judge(claim, summary)
    seeds = {pe: len(row["seeds"]) for pe, row in summary["rows"].items()}
    complete = [seeds.get(pe, 0) >= planned.seeds for pe in (claim.subject, *claim.baselines)]
    if all(complete) or not (complete[0] and seeds.get("rope", 0) >= planned.seeds):
        return claims.judge(claim, summary)
    result, lines = claims.judge(replace(claim, baselines=("rope",)), summary)
    return result + PAIR_ONLY, lines + [
        f"the other baselines ({', '.join(b for b in claim.baselines if b != 'rope')})"
        f" lack some of the planned {planned.seeds} seeds: judged on TAPE against "
        "RoPE only"
    ]


def archived_summaries(folder: Path, task: str) -> list[dict[str, Any]]:
    """The archived comparisons of `task` at its shared rate (those at tuned rates have their own section),
    aggregated, oldest first."""
    return [
        compare.aggregate(directory, write=False)
        for directory in sorted(
            archive.archived_comparisons(folder, task), key=lambda p: (p / compare.COMPARISON_FILE).stat().st_mtime
        )
        if not compare.is_tuned(json.loads((directory / compare.COMPARISON_FILE).read_text()))
    ]


def judge_all(
    context: ReportContext, preset: str = DEFAULT_PRESET
) -> list[tuple[claims.Claim, dict[str, Any] | None, str, list[str]]] | None:
    """Every claim with the comparison at `preset` it is judged on, its verdict and one line per baseline; None
    when no claim has results at that preset."""
    judged, by_task = [], {}
    for claim in claims.CLAIMS:
        if claim.task not in by_task:
            by_task[claim.task] = [
                summary
                for summary in archived_summaries(context.comparisons, claim.task)
                if summary["record"]["preset"] == preset
            ]
        summary = best_comparison(by_task[claim.task], claim, current_hash(claim, preset))
        judged.append((claim, summary, *judge_at_scale(claim, summary, preset)))
    if all(result == "not run" for _, _, result, _ in judged):
        return None
    return judged


def extension_claims(context: ReportContext) -> list[dict[str, Any]]:
    """The claims of `tapelm extend` judged on its committed results (none without results)."""
    from ..pretrained.extend import summarize

    return summarize(extend_results(context)).get("claims", [])


def _by_scale(context: ReportContext) -> dict[str, list] | None:
    """{scale: judge_all at its preset} for the scales with results; None when none has any."""
    found = {scale: judged for scale, preset in SCALES.items() if (judged := judge_all(context, preset))}
    return found or None


def tuned_summary(context: ReportContext, summary: dict[str, Any]) -> dict[str, Any] | None:
    """The archived comparison at tuned rates beside the shared-rate comparison `summary`, aggregated; None when it
    has not run."""
    directory = context.comparisons / summary["task"] / (summary["settings_hash"] + compare.TUNED_SUFFIX)
    return compare.aggregate(directory, write=False) if (directory / compare.COMPARISON_FILE).is_file() else None


def untuned(claim: claims.Claim, tuned: dict[str, Any]) -> list[str]:
    """The encodings a claim compares that its comparison at tuned rates `tuned` lacks: until they are tuned and
    trained there, the claim is not judged at tuned rates (a verdict over fewer baselines is not the claim's)."""
    return [pe for pe in (claim.subject, *claim.baselines) if pe not in tuned["rows"]]


def _at_tuned(context: ReportContext, judged: list | None, index: int) -> str:
    """The laptop claim's verdict on its comparison at tuned rates, marked where it differs from the shared rate's;
    "not run" where there is none, "not yet" while some of its encodings are not in it."""
    claim, summary, result, _ = judged[index] if judged else (None, None, None, None)
    tuned = tuned_summary(context, summary) if summary is not None else None
    if tuned is None:
        return "not run"
    if missing := untuned(claim, tuned):
        return f"not yet ({', '.join(missing)} not tuned)"
    at_tuned, _ = claims.judge(claim, tuned)
    return f"**{at_tuned}**" + (" (*changed*)" if at_tuned != result else "")


def _verdict(by_scale: dict[str, list], scale: str, index: int) -> str:
    judged = by_scale.get(scale)
    return f"**{judged[index][2]}**" if judged and judged[index][2] != "not run" else "not run"


def build(context: ReportContext) -> str | None:
    by_scale, extension = _by_scale(context), extension_claims(context)
    if by_scale is None and not extension:
        return None
    by_scale = by_scale or {}
    doc = (claims.__doc__ or "").split("\n\n", 1)[1].strip().replace("\n", " ")
    lines = [
        doc + " Each scale is judged on its own comparisons (laptop: the `cpu-small` preset; GPU: the `gpu` "
        "preset, run in pieces by `tapelm stage`; docs/RECIPES.md says what each recipe is).",
        "",
        "| claim | " + " | ".join(f"{scale} comparison | {scale}" for scale in SCALES) + " | laptop, tuned rates |",
        "|---|" + "---|---|" * len(SCALES) + "---|",
    ]
    for index, claim in enumerate(claims.CLAIMS):
        cells = []
        for scale in SCALES:
            summary = by_scale[scale][index][1] if scale in by_scale else None
            cells += [
                f"`{claim.task}` {summary['settings_hash']}" if summary else "–",
                _verdict(by_scale, scale, index),
            ]
        cells.append(_at_tuned(context, by_scale.get("laptop"), index))
        lines.append(f"| {claim.statement} | " + " | ".join(cells) + " |")
    lines += [
        f"| {claim['statement']} | `tapelm extend` | **{claim['verdict']}** | – | not run | – |" for claim in extension
    ]
    for scale, judged in by_scale.items():
        for claim, summary, result, details in judged:
            if summary is None:
                continue
            seeds = sorted({seed for row in summary["rows"].values() for seed in row["seeds"]})
            lines += [
                "",
                f"**{claim.name}** at {scale} scale ({claim.headline.replace('_', '-')}, "
                f"{summary['metric'].replace('_', ' ')}, seeds {','.join(map(str, seeds))}): **{result}**.",
                "",
            ]
            lines += [f"- {line}" for line in details]
    for claim in extension:
        lines += ["", f'**{claim["name"]}**: **{claim["verdict"]}** (section "Context extension").', ""]
        lines += [f"- {line}" for line in claim["details"]]
    return "\n".join(lines)


register_section("claims", "Claims: verdicts at laptop and GPU scale", build)

__all__ = [
    "PAIR_ONLY",
    "SCALES",
    "archived_summaries",
    "best_comparison",
    "build",
    "current_hash",
    "judge_all",
    "judge_at_scale",
]
