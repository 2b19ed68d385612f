"""The checkpoint store of a run directory: accelerate state saved to a temporary folder, a manifest of every file's
size and hash written last, one atomic rename; verification, listing, the newest intact one, and the run directory's
check before a new run or a resume."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .settings import TrainSettings

CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_PATTERN = re.compile(r"^step-(\d{8})$")
MANIFEST = "manifest.json"

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint or run directory that cannot be used (corrupt, incomplete, or another configuration's)."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path, step: int, extra: Mapping[str, Any]) -> None:
    """Record every file of a checkpoint with its size and hash; written last, so its presence means complete."""
    files = {
        p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    payload = {"step": step, "files": files, **extra}
    temporary = directory / (MANIFEST + ".tmp")
    temporary.write_text(json.dumps(payload, indent=1))
    os.replace(temporary, directory / MANIFEST)


def verify_checkpoint(directory: Path) -> dict[str, Any]:
    """The manifest of a complete, intact checkpoint; CheckpointError naming the problem otherwise."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint '{directory}' is incomplete: it has no {MANIFEST}")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        int(manifest["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise CheckpointError(f"checkpoint '{directory}' is corrupt: {MANIFEST} is unreadable") from None
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint '{directory}' is incomplete: {name} is missing")
        if path.stat().st_size != expected["bytes"] or _sha256(path) != expected["sha256"]:
            raise CheckpointError(
                f"checkpoint '{directory}' is corrupt: {name} does not match its recorded size and hash"
            )
    return manifest


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of finished checkpoint folders, oldest first. Temporary folders of an interrupted write
    (`.step-N.tmp*`) never match."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := CHECKPOINT_PATTERN.match(p.name))]
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    """The newest finished checkpoint, verified; CheckpointError if it is corrupt or incomplete."""
    found = list_checkpoints(run_dir)
    if not found:
        return None
    step, path = found[-1]
    verify_checkpoint(path)
    return step, path


def newest_intact_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    """The newest checkpoint that verifies, with a warning for every newer one that does not (a resume from it
    overwrites them); CheckpointError when there are checkpoints and none is intact."""
    found = list_checkpoints(run_dir)
    problems = []
    for step, path in reversed(found):
        try:
            verify_checkpoint(path)
        except CheckpointError as error:
            problems.append(str(error))
            continue
        for problem in problems:
            logger.warning(
                "tapelm: %s; resuming from the intact '%s' instead (removing the damaged folder silences this)",
                problem,
                path,
            )
        return step, path
    if problems:
        raise CheckpointError(
            f"{problems[0]}, and no older checkpoint is intact; remove "
            f"'{Path(run_dir) / CHECKPOINT_DIR}' to start the run afresh"
        )
    return None


def save_checkpoint(accelerator, run_dir: Path, step: int, micro: int, keep_last: int, seconds: float) -> Path:
    """accelerate's save_state into a temporary folder, a manifest (with the data position `micro` and the
    `seconds` the run has trained so far, over all its sessions), then one atomic rename."""
    root = run_dir / CHECKPOINT_DIR
    final = root / f"step-{step:08d}"
    temporary = root / f".step-{step:08d}.tmp"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        if temporary.exists():
            shutil.rmtree(temporary)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(temporary), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        extra = {"data_position": micro, "world_size": accelerator.num_processes, "train_seconds": seconds}
        write_manifest(temporary, step, extra)
        if final.exists():
            shutil.rmtree(final)
        os.replace(temporary, final)
        for _, old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def check_run_dir(run_dir: Path, settings: TrainSettings, resume: bool) -> tuple[int, Path] | None:
    """Validate `run_dir` for a new run or a resume before anything is written; the checkpoint to resume from.

    Raises CheckpointError when the folder holds a run with other settings, a run without `resume`, or checkpoints
    none of which is intact (a damaged newest one falls back to the newest intact one, with a warning)."""
    run_dir = Path(run_dir)
    saved = run_dir / "settings.json"
    if saved.exists():
        try:
            previous = json.loads(saved.read_text())
        except json.JSONDecodeError:
            raise CheckpointError(f"run directory '{run_dir}' has an unreadable settings.json") from None
        if previous != settings.to_dict():
            changed = sorted(
                k for k in set(previous) | set(settings.to_dict()) if previous.get(k) != settings.to_dict().get(k)
            )
            raise CheckpointError(
                f"run directory '{run_dir}' belongs to another configuration (different "
                f"{', '.join(changed)}); choose another run directory"
            )
        if not resume:
            raise CheckpointError(
                f"run directory '{run_dir}' already holds a run; resume=True continues it "
                "or choose another run directory"
            )
    elif list_checkpoints(run_dir):
        raise CheckpointError(
            f"run directory '{run_dir}' holds checkpoints but no settings.json; it is not a tapelm run to resume"
        )
    return newest_intact_checkpoint(run_dir) if resume else None
