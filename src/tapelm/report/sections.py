"""The registries of report sections: each kind of result adds one to docs/RESULTS.md with
`register_section(name, title, build)`, and a table of the README's with `register_readme_section(name, build)`."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ReportContext:
    """What a section builder may read and write: the results cache, the comparisons' archive (see `archive`) and
    the figures folder (with its path as seen from the report, and from the README)."""

    root: Path
    figures: Path
    figures_link: str
    comparisons: Path
    readme_figures_link: str = "docs/figures"


@dataclass(frozen=True)
class Section:
    name: str
    title: str
    build: Callable[[ReportContext], str | None]


SECTIONS: dict[str, Section] = {}


def register_section(name: str, title: str, build: Callable[[ReportContext], str | None]) -> None:
    """Add (or replace) a report section; sections appear in registration order when first written."""
    if not re.fullmatch(r"[a-z0-9-]+", name):
        raise ValueError(f"section name {name!r} is not allowed; use lower-case letters, digits and '-'")
    SECTIONS[name] = Section(name, title, build)


README_SECTIONS: dict[str, Callable[[ReportContext], str | None]] = {}


def register_readme_section(name: str, build: Callable[[ReportContext], str | None]) -> None:
    """Add (or replace) a section of the README (`tapelm report --readme`): `build(context) -> markdown | None` is
    written between the README's `<!-- tapelm-report:begin NAME -->` / `end NAME` markers, with no title."""
    if not re.fullmatch(r"[a-z0-9-]+", name):
        raise ValueError(f"section name {name!r} is not allowed; use lower-case letters, digits and '-'")
    README_SECTIONS[name] = build
