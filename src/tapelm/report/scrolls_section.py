"""The report section of the SCROLLS laptop end-to-end run (`tapelm scrolls laptop`): built from the committed JSON
files in docs/results/scrolls-laptop (next to the report's figures folder)."""

from __future__ import annotations

from pathlib import Path

from ..scrolls.laptop import SECTION, TITLE, results_section
from .sections import ReportContext, register_section


def build(context: ReportContext) -> str | None:
    return results_section(Path(context.figures).parent / "results" / "scrolls-laptop")


register_section(SECTION, TITLE, build)

__all__ = ["build"]
