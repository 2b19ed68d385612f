"""constraints.txt, the lock of the README's set-up: `write` it from pyproject.toml, or `check` that it still matches.

    python .ci/lock.py write   # needs uv (pip install uv) and the package index; then commit constraints.txt
    python .ci/lock.py check   # CI: no network; fails when pyproject.toml's requirements changed since `write`
    pip freeze | python .ci/lock.py newer   # CI's newest-releases stage: what it runs that the lock does not pin

`write` resolves every requirement of tapelm and of all its extras with `uv pip compile --universal` (one set of
versions for every platform and Python tapelm supports, each pin with the markers where it applies), holding torch at
the CPU wheel this kind of machine has on disk (TORCH). `check` recomputes the fingerprint of pyproject.toml's
requirements that `write` recorded, and checks that every requirement is met by the pins that apply here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
LOCK = ROOT / "constraints.txt"
TORCH = "torch==2.13.0"
FINGERPRINT = "# pyproject requirements sha256: "
HEADER = f"""# The lock of the README's set-up: every package tapelm and its extras need, at versions tested together.
# Written from pyproject.toml by `python .ci/lock.py write` (uv pip compile --universal; {TORCH}, the CPU wheel on
# this kind of machine, where a newer torch would be a multi-GB CUDA build). CI's `python .ci/lock.py check` fails when
# pyproject.toml's requirements change without a new lock; CI's last stage tests the newest versions they allow.
"""


def requirements(project: dict) -> dict:
    """What the lock is made from: the Python range, the requirements, every extra's, and the torch pin."""
    return {
        "requires-python": project["requires-python"],
        "dependencies": sorted(project["dependencies"]),
        "optional-dependencies": {name: sorted(reqs) for name, reqs in project["optional-dependencies"].items()},
        "torch": TORCH,
    }


def fingerprint(project: dict) -> str:
    return hashlib.sha256(json.dumps(requirements(project), sort_keys=True).encode()).hexdigest()


def write(project: dict) -> None:
    uv = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    if uv is None:
        sys.exit("lock.py write: uv is not installed; install it (pip install uv) and run this again")
    oldest = project["requires-python"].removeprefix(">=")
    with tempfile.TemporaryDirectory() as folder:
        pin, resolved = Path(folder) / "torch.txt", Path(folder) / "lock.txt"
        pin.write_text(TORCH + "\n")
        command = [uv, "pip", "compile", str(PYPROJECT), "--all-extras", "--universal", "--python-version", oldest]
        command += ["--constraint", str(pin), "--no-header", "--output-file", str(resolved), "--quiet"]
        subprocess.run(command, check=True, cwd=ROOT)
        body = resolved.read_text()
    LOCK.write_text(HEADER + FINGERPRINT + fingerprint(project) + "\n" + body)
    print(f"wrote {LOCK.relative_to(ROOT)}: {sum(1 for line in body.splitlines() if '==' in line)} pins")


def pins() -> list[Requirement]:
    """The lock's pins whose markers apply on this machine."""
    found = []
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate():
                found.append(requirement)
    return found


def check(project: dict) -> list[str]:
    """What is wrong with the lock against pyproject.toml, or nothing."""
    recorded = next((line for line in LOCK.read_text().splitlines() if line.startswith(FINGERPRINT)), None)
    if recorded is None or recorded.removeprefix(FINGERPRINT) != fingerprint(project):
        return [
            "pyproject.toml's requirements changed since constraints.txt was written: run `python .ci/lock.py write`"
        ]
    pinned = {pin.name.lower().replace("_", "-"): Version(str(next(iter(pin.specifier)).version)) for pin in pins()}
    problems = []
    wanted = [*project["dependencies"], *(r for reqs in project["optional-dependencies"].values() for r in reqs)]
    for line in wanted:
        requirement = Requirement(line)
        name = requirement.name.lower().replace("_", "-")
        if name == "tapelm" or (requirement.marker is not None and not requirement.marker.evaluate({"extra": ""})):
            continue
        if name not in pinned:
            problems.append(f"{line}: not pinned in constraints.txt")
        elif not requirement.specifier.contains(pinned[name], prereleases=True):
            problems.append(f"{line}: constraints.txt pins {name}=={pinned[name]}")
    return problems


def newer(frozen: str) -> list[str]:
    """The packages of `pip freeze` output whose versions differ from the lock's pins that apply here."""
    pinned = {pin.name.lower().replace("_", "-"): str(next(iter(pin.specifier)).version) for pin in pins()}
    differ = []
    for line in frozen.splitlines():
        name, _, version = line.partition("==")
        locked = pinned.get(name.strip().lower().replace("_", "-"))
        if version and locked is not None and Version(version).public != Version(locked).public:
            differ.append(f"{name.strip()} {version} (the lock: {locked})")
    return differ


def main() -> None:
    if sys.argv[1:] not in (["write"], ["check"], ["newer"]):
        sys.exit("usage: python .ci/lock.py write|check|newer")
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    if sys.argv[1] == "write":
        write(project)
        return
    if sys.argv[1] == "newer":
        differ = newer(sys.stdin.read())
        print("newest releases: " + ("; ".join(differ) if differ else "the same versions as the lock"))
        return
    problems = check(project)
    for problem in problems:
        print(f"lock: {problem}", file=sys.stderr)
    if problems:
        sys.exit(1)
    print("lock: constraints.txt matches pyproject.toml")


if __name__ == "__main__":
    main()
