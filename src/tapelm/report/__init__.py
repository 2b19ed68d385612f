"""`tapelm report`: docs/RESULTS.md and its figures, built from cached results only — never by hand.

The file is made of sections. Each registered section owns the text between its two markers

    <!-- tapelm-report:begin NAME -->  ...  <!-- tapelm-report:end NAME -->

and is rewritten from its results every time (comparisons are first archived next to the file, in results/compare,
and read from there, so that they outlive the `runs/` cache: see `tapelm.experiments.archive`); a section with no
results yet keeps what it had; everything outside the markers (text other people or tools wrote) is kept as it is. A
new kind of result adds a section with `register_section(name, title, build)`, where `build(context) -> markdown |
None`. The README's generated first screen (the figure and table of `glance_section`) is a section of the same
kind, registered with `register_readme_section(name, build)`: a README with none of the markers is not touched, one
with only some of them is refused before anything is written.
"""

from __future__ import annotations

from pathlib import Path

from ..analysis.markdown import HEADER, markers, splice
from ..experiments import archive
from .sections import README_SECTIONS, SECTIONS, ReportContext, register_readme_section, register_section


def build_report(
    root: str | Path = "runs",
    out: str | Path = "docs/RESULTS.md",
    figures: str | Path | None = None,
    sections: list[str] | None = None,
    readme: str | Path | None = None,
) -> list[str]:
    """Rebuild the sections (all registered ones, or `sections`) of `out` from the results under `root`, and the
    README's tables (`README_SECTIONS`) in `readme` when given and it has their markers (see `readme_sections`);
    returns the names of the sections written."""
    from . import (  # noqa: F401  (each registers its section)
        claims_section,
        cost_section,
        coverage_section,
        extend_section,
        findings_section,
        glance_section,
        ladder_section,
        lengths_section,
        options_section,
        pretrained_section,
        scrolls_section,
        tasks_section,
        tuned_section,
    )

    root, out = Path(root), Path(out)
    figures = Path(figures) if figures is not None else out.parent / "figures"
    chosen = sections or list(SECTIONS)
    unknown = [name for name in chosen if name not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown report section '{unknown[0]}'; choose from: {', '.join(SECTIONS)}")
    if not root.is_dir():
        raise ValueError(f"results folder '{root}' does not exist; run `tapelm compare` first or pass --root")
    readme = Path(readme) if readme is not None and Path(readme).is_file() else None
    in_readme = readme_sections(readme.read_text(), str(readme)) if readme is not None else []
    context = ReportContext(
        root=root,
        figures=figures,
        figures_link=_link(figures, out.parent),
        comparisons=out.parent / "results" / "compare",
        readme_figures_link=_link(figures, readme.parent if readme is not None else Path(".")),
    )
    archive.archive_comparisons(root, context.comparisons)
    contents = {}
    for name in chosen:
        content = SECTIONS[name].build(context)
        if content is not None:
            contents[name] = f"## {SECTIONS[name].title}\n\n{content}"
    if not contents:
        raise ValueError(f"no cached results under '{root}' for the sections {', '.join(chosen)}; nothing written")
    document = out.read_text() if out.exists() else HEADER
    for name, content in contents.items():
        document = splice(document, name, content)
    _write_atomically(out, document)
    if in_readme:
        text = readme.read_text()
        for name in in_readme:
            table = README_SECTIONS[name](context)
            if table is not None:
                text = splice(text, name, table)
                contents[f"{readme}:{name}"] = table
        _write_atomically(readme, text)
    return list(contents)


def _link(folder: Path, seen_from: Path) -> str:
    """`folder` as a markdown file in `seen_from` links to it (absolute where it is not below that folder)."""
    try:
        return folder.resolve().relative_to(seen_from.resolve()).as_posix()
    except ValueError:
        return folder.resolve().as_posix()


def readme_sections(text: str, where: str) -> list[str]:
    """The README tables that `text` (the file `where`) has markers for: none, where the file is not one the report
    writes, or every registered one, each with one begin marker and one end marker after it; anything else (a table
    lost in an edit, a marker without its pair) raises ValueError in one line, so that no table silently stops
    being rewritten."""
    found, missing = [], []
    for name in README_SECTIONS:
        begin, end = markers(name)
        counts = text.count(begin), text.count(end)
        if counts == (0, 0):
            missing.append(name)
        elif counts != (1, 1) or text.index(begin) > text.index(end):
            raise ValueError(
                f"{where}: the '{name}' table needs one '{begin}' and one '{end}' after it; found {counts[0]} begin "
                f"and {counts[1]} end marker(s)"
            )
        else:
            found.append(name)
    if found and missing:
        begin, end = markers(missing[0])
        raise ValueError(
            f"{where} has the report's markers for {', '.join(found)} but not for {', '.join(missing)}: add "
            f"'{begin}' and '{end}' where the table goes"
        )
    return found


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    temporary.replace(path)


def add_commands(commands) -> None:
    """Register `tapelm report` on the `tapelm` sub-command parser."""
    parser = commands.add_parser("report", help="rebuild docs/RESULTS.md and its figures from cached results")
    parser.add_argument("--root", default="runs", help="results cache folder (default: %(default)s)")
    parser.add_argument("--out", default="docs/RESULTS.md", help="markdown file (default: %(default)s)")
    parser.add_argument("--figures", help="figures folder (default: 'figures' next to --out)")
    parser.add_argument("--section", nargs="+", help="only these sections (default: every registered one)")
    parser.add_argument(
        "--readme",
        default="README.md",
        help="also rewrite the findings and verdicts tables of this file, where it has their markers "
        "(default: %(default)s)",
    )
    parser.set_defaults(handler=_report_command)


def _report_command(args) -> None:
    written = build_report(args.root, args.out, args.figures, args.section, args.readme)
    print(f"wrote {args.out} (sections: {', '.join(written)})")


__all__ = [
    "README_SECTIONS",
    "SECTIONS",
    "ReportContext",
    "build_report",
    "readme_sections",
    "register_readme_section",
    "register_section",
    "splice",
]
