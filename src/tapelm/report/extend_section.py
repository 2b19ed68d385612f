"""The report section of `tapelm extend`: built from the committed JSON files in docs/results/extend (next to the
report's figures folder)."""

from __future__ import annotations

from pathlib import Path

from ..pretrained.extend import SECTION, TITLE, results_section
from .sections import ReportContext, register_section


def results_dir(context: ReportContext) -> Path:
    return Path(context.figures).parent / "results" / "extend"


def build(context: ReportContext) -> str | None:
    return results_section(results_dir(context), context.figures, context.figures_link)


register_section(SECTION, TITLE, build)
