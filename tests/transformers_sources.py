"""transformers' own common model tests, loaded from the source release of the installed transformers.

The tests are not in the wheel. `fetch` puts the release's sdist (`pip download --no-binary :all:`) into a cache
folder once; `load_mixins` imports `tests/test_modeling_common.py` from it as the package `transformers_tests`, so
its relative imports resolve inside that release and nothing of it is copied into tapelm.

The sdist ships only the top level of transformers' `tests/`: `test_modeling_common.py` is there, but the
`generation/` and `exporters/` folders it imports from are not. With a full source tree (a git checkout of the
release tag, `TAPELM_TRANSFORMERS_SRC=/path/to/transformers`) the real `GenerationTesterMixin` and
`ExportTesterMixin` are used; with the sdist they are empty stand-ins, so the generate and export tests are simply
not collected (`generation_tests_available()` says which).

    python tests/transformers_sources.py fetch   # download + extract into the cache (once)
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

import transformers

PACKAGE = "transformers_tests"
_MISSING_SIBLINGS = {"exporters.test_export": "ExportTesterMixin", "generation.test_utils": "GenerationTesterMixin"}


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "tapelm" / f"transformers-{transformers.__version__}"


def source_dir() -> Path | None:
    """The transformers source tree to test with: $TAPELM_TRANSFORMERS_SRC, else the fetched sdist; None if absent."""
    given = os.environ.get("TAPELM_TRANSFORMERS_SRC")
    candidate = Path(given) if given else cache_dir()
    return candidate if (candidate / "tests" / "test_modeling_common.py").is_file() else None


def _check_version(root: Path) -> None:
    init = (root / "src" / "transformers" / "__init__.py").read_text()
    if f'__version__ = "{transformers.__version__}"' not in init:
        raise ValueError(
            f"{root} is not the source of the installed transformers {transformers.__version__}; "
            f"fetch it again or point TAPELM_TRANSFORMERS_SRC at that release"
        )


def generation_tests_available(root: Path) -> bool:
    return (root / "tests" / "generation" / "test_utils.py").is_file()


def load_mixins(root: Path) -> types.ModuleType:
    """Import `test_modeling_common` from `root/tests` (stand-ins for the sibling modules the sdist lacks)."""
    _check_version(root)
    if PACKAGE not in sys.modules:
        package = types.ModuleType(PACKAGE)
        package.__path__ = [str(root / "tests")]
        sys.modules[PACKAGE] = package
        for relative, class_name in _MISSING_SIBLINGS.items():
            if (root / "tests" / (relative.replace(".", "/") + ".py")).is_file():
                continue
            parent, _ = relative.split(".")
            sys.modules.setdefault(f"{PACKAGE}.{parent}", types.ModuleType(f"{PACKAGE}.{parent}"))
            stand_in = types.ModuleType(f"{PACKAGE}.{relative}")
            setattr(stand_in, class_name, type(class_name, (), {"__doc__": "absent from the sdist: no tests"}))
            sys.modules[stand_in.__name__] = stand_in
    return importlib.import_module(f"{PACKAGE}.test_modeling_common")


def fetch() -> Path:
    """Download the installed transformers' sdist and extract it into `cache_dir()` (no-op when already there)."""
    target = cache_dir()
    if source_dir() == target:
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"transformers=={transformers.__version__}",
                "-d",
                tmp,
            ],
            check=True,
        )
        (archive,) = Path(tmp).glob("transformers-*.tar.gz")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(Path(tmp, archive.name.removesuffix(".tar.gz")), target)
    return target


if __name__ == "__main__":
    if sys.argv[1:] != ["fetch"]:
        raise SystemExit("usage: python tests/transformers_sources.py fetch")
    print(fetch())
