"""Positional encodings: one module per family, one registry entry per `pe_type`."""

from __future__ import annotations

from .absolute import LearnedAbsolute, NoPE, SinusoidalAbsolute
from .base import CustomInit, LayerPositional, PerLayerEncoding, PositionalEncoding, PositionContext
from .bias import FIRE, ALiBi, CoPE, T5Bias
from .fox import FoX
from .grape_a import GrapeAKey, GrapeAQuery, GrapeAQueryKey
from .grape_ap import GrapeAP
from .grape_m import GrapeContextual, GrapeFixed
from .path import PaTH
from .pope import PoPE
from .rotary import RandPE, RoPE, XPos
from .schedule import Schedule, encodings_in, is_scheduled, layer_encodings, validate_schedule
from .stickbreaking import StickBreaking
from .tape import TapeEncoding, TapeLayer
from .wall import Wall

ENCODINGS: dict[str, type[PositionalEncoding]] = {
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
    "wall": Wall,
    "stickbreaking": StickBreaking,
}


def validate_encodings(config) -> None:
    """Raise ValueError naming the first invalid positional field or combination: the layers' schedule, every
    encoding's own fields (a config carries them all, whatever its `pe_type`), then what each encoding its layers use
    needs."""
    validate_schedule(config, ENCODINGS)
    for encoding in dict.fromkeys(ENCODINGS.values()):
        encoding.validate_fields(config)
    for name in encodings_in(config):
        chosen = ENCODINGS[name]
        if chosen.causal_only and not config.causal:
            raise ValueError(
                f"causal=False is not allowed with pe_type={name!r}: its positional signal only "
                "runs from earlier to later tokens"
            )
        chosen.validate_config(config)


def build_encoding(config) -> PositionalEncoding:
    """The model-level encoding: the one `config.pe_type` names, or a `Schedule` of the layers' encodings."""
    return Schedule(config, ENCODINGS) if is_scheduled(config) else ENCODINGS[config.pe_type](config)


__all__ = [
    "ENCODINGS",
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
