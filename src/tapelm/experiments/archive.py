"""The comparisons' archive: the small result files of every `tapelm compare` folder, copied next to the report
(docs/results/compare/TASK/HASH/...) so that a report can be rebuilt, and a comparison continued (`tapelm compare
--archive`, `tapelm stage`), on a machine that no longer has the `runs/` cache (it is ignored by git and lost with
the machine).

Layout as in a comparison folder: comparison.json, then PE/seedN/{result.json, eval.json, metrics.jsonl}; models and
checkpoints stay behind. Copying merges: comparison records keep the union of their encodings, seeds, runs asked for
and commands, and runs already archived stay when the cache no longer has them.
"""

from __future__ import annotations

import json
from pathlib import Path

from .compare import COMPARISON_FILE, copy_atomically, merge_records
from .runs import RESULT_FILES


def archive_comparison(source: Path, archive: Path, runs: list[tuple[str, int]] | None = None) -> Path:
    """Copy the comparison folder `source` into `archive`/TASK/HASH: its record (merged with the archived one) and
    its finished runs, or only those of `runs` ([(pe, seed)]); returns the folder written."""
    source = Path(source)
    target = Path(archive) / source.parent.name / source.name
    merged = merge_records(
        json.loads((target / COMPARISON_FILE).read_text()) if (target / COMPARISON_FILE).exists() else {},
        json.loads((source / COMPARISON_FILE).read_text()),
    )
    chosen = None if runs is None else {f"{pe}/seed{seed}" for pe, seed in runs}
    for result in sorted(source.glob("*/seed*/result.json")):
        run = result.parent.relative_to(source)
        if chosen is not None and run.as_posix() not in chosen:
            continue
        for name in RESULT_FILES:
            if (result.parent / name).exists():
                copy_atomically(result.parent / name, target / run / name)
    target.mkdir(parents=True, exist_ok=True)
    (target / (COMPARISON_FILE + ".tmp")).write_text(json.dumps(merged, indent=1))
    (target / (COMPARISON_FILE + ".tmp")).replace(target / COMPARISON_FILE)
    return target


def archive_comparisons(root: Path, archive: Path) -> list[Path]:
    """Copy every comparison under `root`/compare into `archive` (finished runs only); returns the folders written."""
    return [
        archive_comparison(record.parent, archive)
        for record in sorted(Path(root).glob(f"compare/*/*/{COMPARISON_FILE}"))
    ]


def archived_comparisons(archive: Path, task: str = "*") -> list[Path]:
    """The archived comparison folders (of `task`, or all), sorted by task then settings hash."""
    return [p.parent for p in sorted(Path(archive).glob(f"{task}/*/{COMPARISON_FILE}"))]


__all__ = ["archive_comparison", "archive_comparisons", "archived_comparisons"]
