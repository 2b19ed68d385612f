"""The report section "Far beyond the training length": for every archived comparison evaluated at 8x its training
length or more, each encoding's accuracy against length (table and figure, log axis) and its fall per doubling, and
whether accumulating encodings fall faster than decaying ones (`tapelm.experiments.lengths`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..analysis.plots import curves
from ..experiments import archive, compare, lengths
from ..experiments.tasks import get_task
from ..variants import GATED_SUFFIX
from .sections import ReportContext, register_section

INTRO = (
    "Does an encoding that accumulates position along the sequence (TAPE, PaTH, GRAPE-M, Selective RoPE) lose "
    "accuracy faster, far beyond the training length, than one whose attention decays with distance (FoX, "
    "stick-breaking, Wall, ALiBi, GRAPE-A, GRAPE-AP)? "
    "Each comparison below was evaluated at 8x its training length or more. An encoding's fall is the least-squares "
    "slope of its accuracy against log2(length / training length), in points per doubling, where the accuracy at a "
    "length averages the conditions drawn as in training but for their length (flip-flop: the training ignore rate, "
    "without the sparse and dense splits); intervals are 95% t "
    "intervals across seeds. The families are compared paired by seed, over the members that learned the task in "
    "distribution; 'no difference shown' is a null result at this scale, not evidence of equal falls. Where a "
    "comparison has gated rows (the sigmoid output gate on, `ENCODING-gated`), the question is asked again among them "
    "and, beside it, among the same encodings without the gate."
)


def _points(stats: dict[str, float]) -> str:
    text = f"{stats['mean'] * 100:.1f}"
    return text if stats["n"] < 2 else f"{text} ± {stats['half_width'] * 100:.1f}"


def _multiples(record: dict[str, Any], lengths: list[int]) -> dict[int, int]:
    """Each evaluated length's multiple of the training size, the comparison's `eval_multipliers` in order (a length
    in tokens is rarely that multiple of the training length: MQAR's is 1 + 4 x pairs)."""
    return dict(zip(lengths, sorted(record["task_options"]["eval_multipliers"]), strict=True))


def _table(rows: dict[str, dict[str, Any]], multiples: dict[int, int]) -> str:
    widths = rows[next(iter(rows))]["lengths"]
    header = ["encoding", "family"] + [f"{multiples[length]}x ({length})" for length in widths]
    lines = ["| " + " | ".join(header + ["fall per doubling", "seeds"]) + " |", "|" + "---|" * (len(header) + 2)]
    for pe, row in sorted(rows.items(), key=lambda item: -item[1]["fall"]["mean"]):
        cells = [pe + ("" if row["learned"] else " (not learned)"), row["family"] or "–"]
        cells += [_points(row["accuracy"][length]) for length in widths]
        cells += [_points(row["fall"]), str(row["fall"]["n"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _answer(found: dict[str, Any], asked: str = "Accumulating minus decaying fall per doubling") -> str:
    members, difference = found["members"], found["difference"]
    named = "; ".join(f"{family}: {', '.join(names) or 'none learned'}" for family, names in members.items())
    if difference["n"] == 0:
        return f"{asked} ({named}): no seed has a learned member of both, so the question has no answer here."
    shown = {"better": "accumulation falls more slowly", "worse": "accumulation falls faster"}
    outcome = shown.get(found["verdict"], found["verdict"])
    half = "" if difference["n"] < 2 else f" ± {difference['half_width'] * 100:.1f}"
    return f"{asked}: {difference['mean'] * 100:+.1f}{half} points ({difference['n']} seeds; {named}): **{outcome}**."


def _answers(rows: dict[str, dict[str, Any]]) -> str:
    """The families' answer; where the comparison has gated members, the answer with the gate on and, beside it, the
    answer over the same encodings without the gate."""
    answers = [_answer(lengths.family_difference(rows))]
    gated = {pe.removesuffix(GATED_SUFFIX) for pe, row in rows.items() if row["gated"] and row["family"]}
    if gated:
        asked = "With the output gate on, accumulating minus decaying fall per doubling"
        answers.append(_answer(lengths.family_difference(rows, gated=True), asked))
        asked = "The same encodings without the gate"
        answers.append(_answer(lengths.family_difference(rows, among=gated), asked))
    return "\n\n".join(answers)


def _subsection(record: dict[str, Any], rows: dict[str, dict[str, Any]], context: ReportContext) -> str:
    training = rows[next(iter(rows))]["lengths"][0]
    context.figures.mkdir(parents=True, exist_ok=True)
    name = (
        f"lengths-{record['task']}-{record['settings_hash']}.png"  # not under the hash: the task section clears those
    )
    series = {
        pe: (row["lengths"], [row["accuracy"][n]["mean"] for n in row["lengths"]], None) for pe, row in rows.items()
    }
    curves(
        series,
        context.figures / name,
        f"{record['task']}: accuracy against length, mean over seeds",
        "evaluation length (tokens, log scale)",
        "accuracy",
        edge=training,
    )
    title = f"### {record['task']} (`{record['settings_hash']}`, trained at {training} tokens)"
    figure = f"![{record['task']} accuracy against length]({context.figures_link}/{name})"
    table = _table(rows, _multiples(record, rows[next(iter(rows))]["lengths"]))
    return "\n\n".join([title, table, _answers(rows), figure])


def _far(context: ReportContext) -> list[tuple[dict[str, Any], dict[str, dict[str, Any]], Path]]:
    """(record, rows, folder) of every archived comparison of an accuracy that reaches far beyond its training
    length (perplexity has no fall in points and no learned threshold)."""
    found = []
    for directory in archive.archived_comparisons(context.comparisons):
        record = json.loads((directory / compare.COMPARISON_FILE).read_text())
        if not lengths.reaches_far(record):
            continue
        results = compare.load_results(directory)
        if results and all(r["metric"] != "perplexity" for by_seed in results.values() for r in by_seed.values()):
            task = get_task(record["task"], **record.get("task_options", {}))
            found.append((record, lengths.encoding_rows(task, results), directory))
    return found


def build(context: ReportContext) -> str | None:
    parts = [_subsection(record, rows, context) for record, rows, _ in _far(context)]
    return "\n\n".join([INTRO, *parts]) if parts else None


register_section("far-lengths", "Far beyond the training length", build)

__all__ = ["build"]
