"""The report section "Options of the attention": in every archived comparison that holds an encoding with an option
of the attention on (`tapelm.variants.WITH_ATTENTION_OPTIONS`: SSMax, Llama 4's NoPE temperature; any encoding gated)
and the same encoding without it, the option's effect paired by seed: at the training length, beyond it (the mean
over the longer lengths) and at the longest length evaluated; and TAPE minus RoPE with each option beside TAPE minus
RoPE without it, so that a verdict about TAPE can be read with the option on."""

from __future__ import annotations

import json
import math
from typing import Any

from ..analysis.statistics import format_difference, higher_is_better, paired_difference, verdict
from ..experiments import archive, compare
from ..variants import resolve_variant, with_attention_options, without_attention_options
from .sections import ReportContext, register_section

INTRO = (
    "Each option of the attention against the same encoding without it, paired by seed in one comparison (same "
    "data, steps and seeds): the difference at the training length, beyond it (the mean over every longer length "
    "evaluated) and at the longest length, in points (a perplexity's as a ratio), with 95% t intervals over the "
    "seeds. The verdict reads the difference beyond the training length: 'better' or 'worse' when its interval "
    "excludes zero, else 'no difference shown' (a null result at this scale). Then TAPE minus RoPE with each option "
    "on, beside TAPE minus RoPE without it."
)
COLUMNS = ("in distribution", "beyond (mean)", "at the longest")


def _values(by_seed: dict[int, dict[str, Any]], metric: str) -> dict[str, dict[int, float]]:
    """Per column, each seed's value (the logarithm of a perplexity, so that differences are log ratios)."""
    found: dict[str, dict[int, float]] = {column: {} for column in COLUMNS}
    for seed, result in by_seed.items():
        summary = result["summary"]
        at_longest = summary["by_length"][max(summary["by_length"], key=int)]
        for column, value in zip(COLUMNS, (summary["in_distribution"], summary["longer"], at_longest), strict=True):
            if value is not None:
                found[column][seed] = math.log(value) if metric == "perplexity" else value
    return found


def _row(label: str, first: dict, second: dict, metric: str) -> str:
    differences = [paired_difference(first[column], second[column]) for column in COLUMNS]
    cells = [format_difference(d, log_ratio=metric == "perplexity") for d in differences]
    outcome = verdict(differences[1], higher_is_better(metric))
    return f"| {label} | " + " | ".join(cells) + f" | {differences[1]['n']} | {outcome} |"


def _table(record: dict[str, Any], results: dict[str, dict[int, dict[str, Any]]]) -> str | None:
    metric = next(iter(next(iter(results.values())).values()))["metric"]
    values = {pe: _values(by_seed, metric) for pe, by_seed in results.items()}
    with_options = sorted(row for row in values if with_attention_options(row))
    lines = [
        _row(f"{row} − {base}", values[row], values[base], metric)
        for row in with_options
        if (base := without_attention_options(row)) in values
    ]
    specs = {row: resolve_variant(row) for row in with_options}
    with_tape = [
        (row, partner)
        for row, (pe, options) in specs.items()
        for partner, spec in specs.items()
        if pe == "tape" and spec == ("rope", options)
    ]
    lines += [_row(f"{row} − {partner}", values[row], values[partner], metric) for row, partner in with_tape]
    if with_tape and "tape" in values and "rope" in values:
        lines.append(_row("tape − rope (no option)", values["tape"], values["rope"], metric))
    if not lines:
        return None
    header = f"| {record['task']} (`{record['settings_hash']}`) | " + " | ".join(COLUMNS) + " | seeds | verdict |"
    return "\n".join([header, "|---|---|---|---|---|---|", *lines])


def build(context: ReportContext) -> str | None:
    tables = []
    for directory in archive.archived_comparisons(context.comparisons):
        record = json.loads((directory / compare.COMPARISON_FILE).read_text())
        results = compare.load_results(directory)
        table = _table(record, results) if results else None
        if table:
            tables.append(table)
    return "\n\n".join([INTRO, *tables]) if tables else None


register_section("attention-options", "Options of the attention", build)
