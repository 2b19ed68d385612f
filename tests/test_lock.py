"""constraints.txt, the lock of the README's set-up, matches pyproject.toml (.ci/lock.py check, run in CI), and the
check fails when either side moves."""

from __future__ import annotations

import copy
import importlib.util
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lock_module():
    spec = importlib.util.spec_from_file_location("lock", ROOT / ".ci" / "lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_lock_matches_pyproject():
    assert lock_module().check(PROJECT) == []


def test_a_changed_requirement_needs_a_new_lock():
    changed = copy.deepcopy(PROJECT)
    changed["optional-dependencies"]["lab"].append("einops>=0.8")
    assert "changed since constraints.txt was written" in lock_module().check(changed)[0]


def test_a_pin_outside_a_requirement_is_named(monkeypatch, tmp_path):
    lock = lock_module()
    monkeypatch.setattr(lock, "fingerprint", lambda project: "same")
    text = lock.LOCK.read_text().replace(lock.FINGERPRINT, lock.FINGERPRINT + "same\n# was: ")
    (tmp_path / "constraints.txt").write_text(text.replace("\ntransformers==", "\ntransformers==4.57.0\n# was: "))
    monkeypatch.setattr(lock, "LOCK", tmp_path / "constraints.txt")
    assert lock.check(PROJECT) == ["transformers>=5.24,<6: constraints.txt pins transformers==4.57.0"]


def test_newer_names_what_differs_from_the_lock():
    lock = lock_module()
    pinned = next(line for line in lock.LOCK.read_text().splitlines() if line.startswith("transformers=="))
    assert lock.newer(pinned) == []
    locked = pinned.split("==")[1]
    assert lock.newer("transformers==99.0\ntorch==2.13.0+cpu") == [f"transformers 99.0 (the lock: {locked})"]
