"""The real text tapelm trains and evaluates on, by name or by path, and how every corpus is split.

A corpus is one source or a list of sources. A source is:

- "stdlib" (or None): the *.py files of this Python's standard library, without site-packages and test folders;
- "python-docs": the reStructuredText sources of the Python 3.11 documentation (English prose with some code), from
  Debian's python3.11-doc package, fetched once with ``apt-get download`` and unpacked with ``dpkg-deb -x`` into the
  tapelm cache (never committed);
- a file, a directory (every file under it, recursively, skipping hidden and __pycache__ folders) or a glob.

Files are read sorted by path. Split: within each source, file i is held out when i % VAL_EVERY == 0 (a one-file
source holds out its last 1/VAL_EVERY instead), so a held-out file of a source is held out in every corpus that
contains the source.
"""

from __future__ import annotations

import functools
import glob
import logging
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

from ..storage import cache_root

logger = logging.getLogger(__name__)

VAL_EVERY = 20
STDLIB, PYTHON_DOCS = "stdlib", "python-docs"
NAMED_SOURCES = (STDLIB, PYTHON_DOCS)
STDLIB_EXCLUDED = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
DOC_PACKAGE = "python3.11-doc"


def corpus_files(corpus: str | None) -> tuple[Path, ...]:
    """The sorted files of one source (see the module docstring)."""
    if corpus is None or corpus == STDLIB:
        return _standard_library_files()
    if corpus == PYTHON_DOCS:
        files = python_docs().rglob("*.rst.txt")
    elif any(char in corpus for char in "*?["):
        files = (Path(p) for p in glob.glob(corpus, recursive=True))
    elif not Path(corpus).exists():
        raise ValueError(
            f"corpus path '{corpus}' does not exist; pass a file, a directory, a glob or one of the "
            f"names {', '.join(NAMED_SOURCES)}"
        )
    elif Path(corpus).is_file():
        files = iter([Path(corpus)])
    else:
        root = Path(corpus)
        files = (p for p in root.rglob("*") if not _hidden(p.relative_to(root)))
    found = tuple(sorted(p for p in files if p.is_file()))
    if not found:
        raise ValueError(f"corpus path '{corpus}' does not exist or holds no files")
    return found


@functools.cache
def _standard_library_files() -> tuple[Path, ...]:
    """The standard library's files, listed once per process: they are this Python's own and do not change."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = (p for p in root.rglob("*.py") if not STDLIB_EXCLUDED & set(p.relative_to(root).parts[:-1]))
    return tuple(sorted(p for p in files if p.is_file()))


def corpus_sources(corpus: str | list[str] | tuple[str, ...] | None) -> tuple[tuple[Path, ...], ...]:
    """The sorted files of every source of `corpus` (one source or a list of them), source by source."""
    if isinstance(corpus, (list, tuple)):
        if not corpus or not all(isinstance(source, str) for source in corpus):
            raise ValueError(f"corpus={corpus!r} is not allowed; give a source or a non-empty list of sources")
        return tuple(corpus_files(source) for source in dict.fromkeys(corpus))
    if corpus is not None and not isinstance(corpus, str):
        raise ValueError(f"corpus={corpus!r} is not allowed; give a source or a list of sources")
    return (corpus_files(corpus),)


def split_files(files: list[Path] | tuple[Path, ...]) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of one source of several files."""
    return [f for i, f in enumerate(files) if i % VAL_EVERY], list(files[::VAL_EVERY])


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") or part == "__pycache__" for part in relative.parts)


def python_docs(root: Path | None = None) -> Path:
    """The folder of python3.11-doc's .rst.txt sources, fetched and unpacked into the tapelm cache on first use;
    ValueError when it cannot be fetched (give a folder of text files instead)."""
    root = Path(root) if root is not None else cache_root() / DOC_PACKAGE
    sources = root / "usr/share/doc/python3.11/html/_sources"
    if sources.is_dir():
        return sources
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise ValueError(
            f"the prose corpus '{PYTHON_DOCS}' is Debian's {DOC_PACKAGE}, and apt-get / dpkg-deb are "
            "not available here to fetch it; give a folder of text files instead"
        )
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=".tmp-doc-") as tmp:
        logger.warning("tapelm: fetching %s with apt-get download into %s (once)", DOC_PACKAGE, root)
        done = subprocess.run(["apt-get", "download", DOC_PACKAGE], cwd=tmp, capture_output=True, text=True)
        debs = list(Path(tmp).glob("*.deb"))
        if done.returncode != 0 or len(debs) != 1:
            reason = (done.stderr.strip().splitlines() or ["no package downloaded"])[-1][-200:]
            raise ValueError(
                f"apt-get download {DOC_PACKAGE} (the prose corpus '{PYTHON_DOCS}') failed ({reason}); "
                "give a folder of text files instead"
            )
        staged = Path(tmp) / "x"
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(staged)], check=True)
        if root.exists():
            shutil.rmtree(root)
        staged.rename(root)
    if not sources.is_dir():
        raise RuntimeError(f"{DOC_PACKAGE} did not contain {sources}")
    return sources
