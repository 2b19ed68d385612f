"""What every result records about where it was made: commit, versions, machine, threads and load."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch


def installed_version(package: str) -> str | None:
    """The installed version of `package`, or None (e.g. tapelm run from a source checkout that is not installed:
    the commit identifies it)."""
    try:
        return version(package)
    except PackageNotFoundError:
        return None


SOURCE_ROOT = Path(__file__).resolve().parents[3]
"""The folder holding src/tapelm: a source checkout's root."""


def _git(*args: str) -> str | None:
    """git's output in tapelm's own checkout, or None where tapelm's source does not lie at the top of a git work
    tree (an installed package; a copy of the tree inside another project's checkout, whose commit is not tapelm's)."""
    top = _run_git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != SOURCE_ROOT:
        return None
    return _run_git(*args)


def _run_git(*args: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=True, cwd=SOURCE_ROOT
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def source_digest() -> str:
    """sha256 of tapelm's Python sources (their paths and contents): the code's identity where no git checkout
    gives its commit, e.g. a copy of the tree on a lent GPU."""
    root = Path(__file__).parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def device_name() -> str:
    """The device this process computes on (accelerate's choice) by name, e.g. "NVIDIA H100 80GB HBM3"; else its
    type ("cpu")."""
    from .devices import process_device

    device = process_device()
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def environment() -> dict:
    """Commit (and whether tapelm's source has uncommitted changes, which the commit then does not identify),
    versions, machine and device, recorded with every result."""
    import transformers

    commit = _git("rev-parse", "HEAD")
    changes = _git("status", "--porcelain", "--untracked-files=no", "--", str(Path(__file__).parents[1]))
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [
            line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    return {
        "commit": commit or "unknown",
        "source_differs_from_commit": None if changes is None else bool(changes),
        "tapelm": installed_version("tapelm") or "source tree (not installed)",
        "source_sha256": source_digest(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "accelerate": installed_version("accelerate"),
        "triton": installed_version("triton"),
        "fla": installed_version("flash-linear-attention"),
        "python": sys.version.split()[0],
        "device": device_name(),
        "machine": platform.machine(),
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "load_average_before": os.getloadavg(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
