"""The comparisons' archive: the small result files of every `tapelm compare` folder, copied next to the report
(docs/results/compare/TASK/HASH/...) so that a report can be rebuilt, and a comparison continued (`tapelm compare
--archive`), on a machine that no longer has the `runs/` cache (it is ignored by git and lost with the machine).

Layout as in a comparison folder: comparison.json, then PE/seedN/{result.json, eval.json, metrics.jsonl}; models and
checkpoints stay behind. Copying merges: comparison records keep the union of their encodings, seeds, runs asked for
and commands, and runs already archived stay when the cache no longer has them.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..experiments.compare import COMPARISON_FILE, copy_atomically, merge_records
from ..experiments.runs import RESULT_FILES


def _merged_record(source: Path, target: Path) -> dict:
    return merge_records(json.loads(target.read_text()) if target.exists() else {}, json.loads(source.read_text()))


def archive_comparisons(root: Path, archive: Path) -> list[Path]:
    """Copy every comparison under `root`/compare into `archive` (finished runs only); returns the folders written."""
    written = []
    for record in sorted(Path(root).glob(f"compare/*/*/{COMPARISON_FILE}")):
        source = record.parent
        target = Path(archive) / source.parent.name / source.name
        merged = _merged_record(record, target / COMPARISON_FILE)
        for result in sorted(source.glob("*/seed*/result.json")):
            for name in RESULT_FILES:
                if (result.parent / name).exists():
                    copy_atomically(result.parent / name, target / result.parent.relative_to(source) / name)
        target.mkdir(parents=True, exist_ok=True)
        (target / (COMPARISON_FILE + ".tmp")).write_text(json.dumps(merged, indent=1))
        (target / (COMPARISON_FILE + ".tmp")).replace(target / COMPARISON_FILE)
        written.append(target)
    return written


def archived_comparisons(archive: Path, task: str = "*") -> list[Path]:
    """The archived comparison folders (of `task`, or all), sorted by task then settings hash."""
    return [p.parent for p in sorted(Path(archive).glob(f"{task}/*/{COMPARISON_FILE}"))]


__all__ = ["archive_comparisons", "archived_comparisons"]
