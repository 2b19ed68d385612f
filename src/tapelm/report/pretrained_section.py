"""The report section of the retrofit experiment: built from the committed JSON files in docs/results/pretrained
(next to the report's figures folder)."""

from __future__ import annotations

from pathlib import Path

from ..pretrained.retrofit import SECTION, TITLE, results_section
from .sections import ReportContext, register_section


def build(context: ReportContext) -> str | None:
    results_dir = Path(context.figures).parent / "results" / "pretrained"
    if not any(results_dir.glob("*.json")):
        return None
    return results_section(results_dir)


register_section(SECTION, TITLE, build)
