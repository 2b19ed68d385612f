"""The "CPU time per run" section of docs/RESULTS.md: for each task's recipe (the comparisons of the findings), how
many runs of each encoding one CPU core finishes per hour, and the cost as a multiple of RoPE's in the same
comparison. Read from the runs' own records (training seconds over every session, plus the evaluation's), so that it
is the budget the comparisons really cost on this machine, not a benchmark: runs train on one thread each, usually
two at a time on the 2-core machine, so a run's seconds include its share of a busy machine."""

from __future__ import annotations

import statistics
from typing import Any

from ..experiments import compare
from . import findings_section as findings
from .sections import ReportContext, register_section

INTRO = (
    "Runs per CPU-hour: 3,600 over the median seconds of a run (training over every session it took, plus its "
    "evaluation at every length), over the seeds archived for the task's findings comparison; × RoPE: that median "
    "over RoPE's in the same comparison. Each run trains on one thread, usually beside one other run on this "
    "2-core machine: these are the costs the comparisons paid, not a benchmark (`tapelm bench training` times a "
    "step with the machine to itself, docs/SPEED.md)."
)


def run_seconds(result: dict[str, Any]) -> float:
    """A finished run's seconds: training in this and every earlier session, and the evaluation."""
    return (
        result.get("train_seconds_this_session", 0.0)
        + result.get("train_seconds_before_this_session", 0.0)
        + result.get("eval_seconds", 0.0)
    )


def medians(results: dict[str, dict[int, dict[str, Any]]]) -> dict[str, float]:
    """{row: median seconds of its runs} for the rows with a finished run."""
    return {row: statistics.median(map(run_seconds, by_seed.values())) for row, by_seed in results.items() if by_seed}


def _cell(seconds: float | None, reference: float | None) -> str:
    if seconds is None:
        return "–"
    ratio = f" (×{seconds / reference:.2f})" if reference else ""
    return f"{3600 / seconds:.1f}{ratio}"


def build(context: ReportContext) -> str | None:
    columns = []
    for summary, _, _ in findings.entries(context):
        directory = context.comparisons / summary["task"] / summary["settings_hash"]
        columns.append((findings.label(summary), medians(compare.load_results(directory))))
    if not columns:
        return None
    rows = list(dict.fromkeys(row for _, times in columns for row in times))
    lines = [
        INTRO,
        "",
        "| encoding | " + " | ".join(label for label, _ in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for row in rows:
        cells = [_cell(times.get(row), times.get(findings.REFERENCE)) for _, times in columns]
        lines.append(f"| {findings.name(row)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


register_section("cpu-cost", "CPU time per run", build)

__all__ = ["build", "medians", "run_seconds"]
