"""The "Which comparisons are complete" section of docs/RESULTS.md: every comparison of
`tapelm.experiments.plan.OWED` and `AT_GPU_SCALE`, read from the archive at its settings hash."""

from __future__ import annotations

from ..experiments import compare, plan
from .sections import ReportContext, register_section


def _status(owed: plan.OwedComparison, missing: dict[str, int]) -> str:
    if not missing:
        return "complete"
    if all(count == 0 for count in missing.values()) and len(missing) == len(owed.rows):
        return "not run"
    return "partial: " + ", ".join(f"{row} {count}/{owed.seeds}" for row, count in missing.items())


def build(context: ReportContext) -> str:
    lines = [
        f"{plan.__doc__.split(':', 1)[0].replace(chr(10), ' ')}: complete when every row has finished seeds "
        "0 .. n-1 at its recipe (the folder named by its settings hash); the last column runs what is missing "
        "and reuses every finished run, cached in runs/ or archived here. The comparisons at GPU scale run in "
        "pieces on lent GPUs (`tapelm stage`, docs/RECIPES.md).",
        "",
        "| comparison | rows | seeds each | status | to continue |",
        "|---|---|---:|---|---|",
    ]
    for owed in (*plan.OWED, *plan.AT_GPU_SCALE):
        settings_hash = owed.settings_hash()
        directory = context.comparisons / owed.task / settings_hash
        finished = (
            {row: set(runs) for row, runs in compare.load_results(directory).items()} if directory.is_dir() else {}
        )
        missing = owed.missing(finished)
        command = f"`{owed.command(list(missing), context.comparisons.as_posix())}`" if missing else ""
        scale = ", GPU scale" if owed.preset == plan.GPU else ""
        lines.append(
            f"| `{owed.task}` {settings_hash}, {owed.label}{scale} | {' '.join(owed.rows)} | {owed.seeds} | "
            f"{_status(owed, missing)} | {command} |"
        )
    return "\n".join(lines)


register_section("coverage", "Which comparisons are complete", build)

__all__ = ["build"]
