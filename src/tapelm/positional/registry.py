"""The registry of positional encodings: every `pe_type` a config may name, built-in or a user's.

An encoding registers under a name with `register_encoding(name, cls)`: tapelm's own do so when
`tapelm.positional` is imported, and an installed package does so through the entry-point group
`tapelm.encodings` (`name = "module:Class"`), read the first time a name is looked up that is not registered yet or
the whole registry is listed. A config records the package each encoding from outside tapelm comes from
(`encoding_packages`), so that loading a saved model without that package fails naming it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
import sys

from .base import FAMILIES, PositionalEncoding, StepCost, check_bool, check_choice

ENTRY_POINT_GROUP = "tapelm.encodings"
_NAME = re.compile(r"[a-z][a-z0-9]*([-.][a-z0-9]+)*")

_encodings: dict[str, type[PositionalEncoding]] = {}
_packages: dict[str, str] = {}
_entry_points_read = False


def register_encoding(name: str, cls: type[PositionalEncoding], package: str | None = None) -> None:
    """Make `cls` the encoding `pe_type=name` builds.

    `name`: lower case letters and digits, parts joined by "-" or "." (e.g. "kerple-log"). `cls` subclasses
    `tapelm.positional.PositionalEncoding` (or `PerLayerEncoding`) and declares its facts on the class (its docstring
    lists them). `package`: the distribution that provides it, recorded in saved configs (default: the one that
    installed `cls`'s module, if any). Registering a name again with the same class does nothing; with another class
    it is refused."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"encoding name {name!r} is not allowed; use lower case letters and digits, parts joined by '-' or '.' "
            "(e.g. 'kerple-log')"
        )
    if not (isinstance(cls, type) and issubclass(cls, PositionalEncoding)):
        raise ValueError(f"encoding {name!r}: {cls!r} is not a subclass of tapelm.positional.PositionalEncoding")
    _check_facts(name, cls)
    if _encodings.get(name, cls) is not cls:
        raise ValueError(
            f"encoding {name!r} is already registered as {_qualified(_encodings[name])}; choose another name for "
            f"{_qualified(cls)}"
        )
    _encodings[name] = cls
    if package is None:
        package = _distribution_of(cls)
    if package is not None:
        _packages[name] = package


def unregister_encoding(name: str) -> None:
    """Forget encoding `name` (tests register and forget their own; `tapelm.testing.registered_for_test`)."""
    _encodings.pop(name, None)
    _packages.pop(name, None)


def encoding_class(name: str) -> type[PositionalEncoding]:
    """The class registered as `name`; ValueError naming the registered ones otherwise."""
    if name not in _encodings:
        _read_entry_points()
    if name not in _encodings:
        check_choice("pe_type", name, encoding_names())
    return _encodings[name]


def encoding_names() -> tuple[str, ...]:
    """Every registered name, tapelm's own first, then the installed packages' in the order they registered."""
    return tuple(registered())


def registered() -> dict[str, type[PositionalEncoding]]:
    """Every registered name and its class (a copy), tapelm's own first."""
    _read_entry_points()
    return dict(_encodings)


def is_registered(name: str) -> bool:
    """Whether `name` is a registered encoding (installed packages' included)."""
    if name not in _encodings:
        _read_entry_points()
    return name in _encodings


def package_of(name: str) -> str | None:
    """The distribution that registered encoding `name`, or None for tapelm's own and unpackaged ones."""
    return _packages.get(name)


def display_name(name: str) -> str:
    """The name reports give a registered encoding (its class's own `display_name`, else `name`); `name` itself
    otherwise."""
    return (vars(_encodings[name]).get("display_name") or name) if is_registered(name) else name


def _check_facts(name: str, cls: type[PositionalEncoding]) -> None:
    check_bool(f"{name}: relative", cls.relative)
    check_bool(f"{name}: reads_position_limit", cls.reads_position_limit)
    check_choice(f"{name}: family", cls.family, (None, *FAMILIES))
    if cls.step_cost is not None and not isinstance(cls.step_cost, StepCost):
        raise ValueError(f"{name}: step_cost={cls.step_cost!r} is not allowed; give a StepCost or None")
    for field in (*cls.config_fields, *cls.test_options):
        if not isinstance(field, str):
            raise ValueError(f"{name}: config field {field!r} is not allowed; config fields are names (str)")


def _read_entry_points() -> None:
    """Register every encoding that an installed package declares in the entry-point group, once."""
    global _entry_points_read
    if _entry_points_read:
        return
    _entry_points_read = True
    for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        package = point.dist.name if point.dist is not None else None
        try:
            cls = point.load()
        except Exception as error:
            raise ValueError(
                f"the encoding {point.name!r} that package {package!r} declares ({point.value}) cannot be "
                f"imported: {type(error).__name__}: {error}"
            ) from error
        register_encoding(point.name, cls, package)


def _distribution_of(cls: type) -> str | None:
    top = cls.__module__.split(".")[0]
    if top == "tapelm" or top not in sys.modules:
        return None
    names = _distributions().get(top)
    return names[0] if names else None


@functools.cache
def _distributions() -> dict[str, list[str]]:
    """Top-level module -> the installed distributions providing it (a scan of every installed package: once)."""
    return importlib.metadata.packages_distributions()


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


__all__ = [
    "ENTRY_POINT_GROUP",
    "display_name",
    "encoding_class",
    "encoding_names",
    "is_registered",
    "package_of",
    "register_encoding",
    "registered",
    "unregister_encoding",
]
