"""Positional encodings: one module per family, one registry entry per `pe_type`."""

from __future__ import annotations

from .absolute import LearnedAbsolute, NoPE, SinusoidalAbsolute
from .base import (
    FAMILIES,
    CustomInit,
    LayerPositional,
    PerLayerEncoding,
    PositionalEncoding,
    PositionContext,
    StepCost,
    check_choice,
)
from .bias import FIRE, ALiBi, CoPE, T5Bias
from .fox import FoX
from .grape_a import GrapeAKey, GrapeAQuery, GrapeAQueryKey
from .grape_ap import GrapeAP
from .grape_m import GrapeContextual, GrapeFixed
from .path import PaTH
from .pope import PoPE
from .registry import (
    ENTRY_POINT_GROUP,
    display_name,
    encoding_class,
    encoding_names,
    is_registered,
    package_of,
    register_encoding,
    registered,
    unregister_encoding,
)
from .rotary import RandPE, RoPE, XPos
from .schedule import Schedule, encodings_in, is_scheduled, layer_encodings, validate_schedule
from .selective_rope import SelectiveRoPE
from .stickbreaking import StickBreaking
from .tape import TapeEncoding, TapeLayer
from .wall import Wall

BUILT_IN: dict[str, type[PositionalEncoding]] = {
    "tape": TapeEncoding,
    "rope": RoPE,
    "randpe": RandPE,
    "xpos": XPos,
    "nope": NoPE,
    "alibi": ALiBi,
    "t5": T5Bias,
    "fire": FIRE,
    "cope": CoPE,
    "sinusoidal": SinusoidalAbsolute,
    "learned": LearnedAbsolute,
    "fox": FoX,
    "path": PaTH,
    "grape-m-fixed": GrapeFixed,
    "grape-m": GrapeContextual,
    "grape-ap": GrapeAP,
    "grape-a-q": GrapeAQuery,
    "grape-a-k": GrapeAKey,
    "grape-a-qk": GrapeAQueryKey,
    "pope": PoPE,
    "selective-rope": SelectiveRoPE,
    "wall": Wall,
    "stickbreaking": StickBreaking,
}
"""tapelm's own encodings, registered below the way a user's own are."""
for _name, _cls in BUILT_IN.items():
    register_encoding(_name, _cls)


def add_encoding_fields(config) -> None:
    """Give `config` every registered encoding's own fields it lacks (`config_fields`, at their defaults), and record
    in `encoding_packages` the package each of its layers' encodings from outside tapelm comes from."""
    for encoding in registered().values():
        for field, default in encoding.config_fields.items():
            if not hasattr(config, field):
                setattr(config, field, default)
    packages = {name: package for name in _named(config).values() if (package := package_of(name))}
    config.encoding_packages = {**(config.encoding_packages or {}), **packages} or None


def check_registered(config) -> None:
    """Raise ValueError for a layer's encoding that is not registered, naming the package a saved config says it
    comes from (then: install it), or else the registered ones."""
    for field, name in _named(config).items():
        if is_registered(name):
            continue
        package = (config.encoding_packages or {}).get(name)
        if package:
            raise ValueError(
                f"{field}={name!r} is not registered: it comes from the package {package!r}, which is not installed "
                f"here (pip install {package})"
            )
        check_choice(field, name, encoding_names())


def _named(config) -> dict[str, str]:
    """Field -> the encoding it names (`pe_type`, and each entry of a `layer_pe_types` list), before validation."""
    schedule = config.layer_pe_types if isinstance(config.layer_pe_types, list) else []
    return {"pe_type": config.pe_type, **{f"layer_pe_types[{i}]": name for i, name in enumerate(schedule)}}


def validate_encodings(config) -> None:
    """Raise ValueError naming the first invalid positional field or combination: the layers' schedule, every
    encoding's own fields (a config carries them all, whatever its `pe_type`), then what each encoding its layers use
    needs."""
    check_registered(config)
    encodings = registered()
    validate_schedule(config, encodings)
    for encoding in dict.fromkeys(encodings.values()):
        encoding.validate_fields(config)
    for name in encodings_in(config):
        chosen = encodings[name]
        if chosen.causal_only and not config.causal:
            raise ValueError(
                f"causal=False is not allowed with pe_type={name!r}: its positional signal only "
                "runs from earlier to later tokens"
            )
        chosen.validate_config(config)
    check_rope_scaling(config, [encodings[name] for name in encodings_in(config)])


def check_rope_scaling(config, chosen: list) -> None:
    """A RoPE scaling (`rope_parameters`' rope_type other than "default") needs a layer whose encoding honours it
    (`rope_scaling`); refused in one line otherwise, since it would change nothing."""
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if rope_type == "default" or any(encoding.rope_scaling for encoding in chosen):
        return
    honouring = ", ".join(name for name, encoding in registered().items() if encoding.rope_scaling)
    raise ValueError(
        f"rope_parameters rope_type={rope_type!r} is not allowed with pe_type={config.pe_type!r}: no layer reads "
        f"RoPE's frequencies, so the scaling would change nothing; the encodings that honour one: {honouring}"
    )


def build_encoding(config) -> PositionalEncoding:
    """The model-level encoding: the one `config.pe_type` names, or a `Schedule` of the layers' encodings."""
    return Schedule(config, registered()) if is_scheduled(config) else encoding_class(config.pe_type)(config)


__all__ = [
    "BUILT_IN",
    "FAMILIES",
    "add_encoding_fields",
    "check_registered",
    "ENTRY_POINT_GROUP",
    "StepCost",
    "display_name",
    "encoding_class",
    "encoding_names",
    "is_registered",
    "package_of",
    "register_encoding",
    "registered",
    "unregister_encoding",
    "CustomInit",
    "build_encoding",
    "encodings_in",
    "layer_encodings",
    "PositionalEncoding",
    "LayerPositional",
    "PerLayerEncoding",
    "PositionContext",
    "TapeLayer",
    "validate_encodings",
]
