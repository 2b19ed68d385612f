"""Which packages an extra of the installed tapelm lacks: a lab command without `tapelm[lab]` names what to install."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, requires, version

from packaging.requirements import Requirement


def missing(extra: str) -> list[str]:
    """The requirements of `tapelm[extra]` that are not installed, by name (none when tapelm itself is not installed,
    but imported from a source tree)."""
    try:
        lines = requires("tapelm") or []
    except PackageNotFoundError:
        return []
    lacking = []
    for line in lines:
        requirement = Requirement(line)
        if requirement.name == "tapelm" or requirement.marker is None:
            continue  # another extra of tapelm's, or what `pip install tapelm` installs
        if not requirement.marker.evaluate({"extra": extra}):
            continue
        try:
            version(requirement.name)
        except PackageNotFoundError:
            lacking.append(requirement.name)
    return lacking


__all__ = ["missing"]
