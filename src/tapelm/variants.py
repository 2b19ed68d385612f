"""Named model variants that experiments compare like encodings. A variant is a `pe_type` plus TapeConfig options:
TAPE's ablations (the paper's table and the official code's switches; `tapelm ablate TASK` and its own report table),
and the RoPE family's options that are mechanisms of their own (p-RoPE, per-layer NoPE schedules), reported as
encodings. `tapelm compare --pe tape-mlp-only p-rope-0.75 ...` uses these names as rows, and every variant of one
comparison shares its budget."""

from __future__ import annotations

from typing import Any

from .positional import display_name as registered_display_name
from .positional import encoding_names, is_registered

ABLATIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "tape": ("tape", {}),  # full TAPE: attention and MLP updates, E mixed across heads
    "tape-per-head": ("tape", {"tape_attn_mixing": "per_head"}),  # what the official code computes
    "rope": ("rope", {}),  # without context: positions fixed at E0
    "tape-non-equivariant": ("tape", {"tape_equivariant": False}),  # without orthogonal equivariance
    "tape-attention-only": ("tape", {"tape_update": "attention"}),
    "tape-mlp-only": ("tape", {"tape_update": "mlp"}),
    "tape-r4": ("tape", {"tape_block": [2, 4]}),  # L x R = 2 x 4: more positional capacity per block
    "tape-first-half": ("tape", {"tape_layers": "first_half"}),
    "tape-second-half": ("tape", {"tape_layers": "second_half"}),
}
VARIANTS = {name: spec for name, spec in ABLATIONS.items() if name not in ("tape", "rope")}
ROPE_FAMILY: dict[str, tuple[str, dict[str, Any]]] = {
    "p-rope-0.75": ("rope", {"rope_fraction": 0.75}),  # p-RoPE: the lowest quarter of the frequencies do not rotate
    "rope-nope-every-4th": ("rope", {"layer_pe_types": "nope-every-4th"}),  # SmolLM3's and Llama 4's placement
    "rope-nope-every-2nd": ("rope", {"layer_pe_types": "nope-every-2nd"}),  # RNoPE's interleaving, no window
}
"""Encodings spelled as RoPE's options (docs/ENCODINGS.md): compared and reported as encodings of their own."""
LLAMA4_NOPE = {"layer_pe_types": "nope-every-4th", "nope_temperature_tuning": True}
WITH_ATTENTION_OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "rope-ssmax": ("rope", {"ssmax": True}),
    "tape-ssmax": ("tape", {"ssmax": True}),
    # Llama 4's NoPE layers, their temperature starting to grow at 128 keys (Llama 4's at 8192): flip-flop's training
    # length in its far-lengths recipe; MQAR's 2-layer model has no 4th layer, so its row makes every 2nd layer NoPE
    # and starts at 16 keys
    "rope-nope-every-4th-temp128": ("rope", {**LLAMA4_NOPE, "nope_floor_scale": 128.0}),
    "rope-nope-every-2nd-temp16": (
        "rope",
        {**LLAMA4_NOPE, "layer_pe_types": "nope-every-2nd", "nope_floor_scale": 16.0},
    ),
}
"""Encodings with options of the attention on (`tapelm.attention_options`, Llama 4's NoPE temperature): rows of their
own, paired by seed with the same encodings without them. Any encoding also takes the output gate as a row of its own,
its name plus GATED_SUFFIX (`gated_row`)."""
GATED_SUFFIX = "-gated"
GATE = {"attention_gate": "elementwise"}  # gated attention's best variant: an elementwise sigmoid gate


def gated_row(name: str) -> tuple[str, dict[str, Any]] | None:
    """(encoding, GATE) for a registered encoding's name plus GATED_SUFFIX ("path-gated"); None for any other name,
    a registered encoding's own included."""
    stem = name.removesuffix(GATED_SUFFIX)
    return (stem, dict(GATE)) if stem != name and is_registered(stem) and not is_registered(name) else None


ROPE_FAMILY_NAMES = {
    "p-rope-0.75": "p-RoPE (0.75)",
    "rope-nope-every-4th": "RoPE (NoPE every 4th layer)",
    "rope-nope-every-2nd": "RoPE (NoPE every 2nd layer)",
    "rope-ssmax": "RoPE + SSMax",
    "tape-ssmax": "TAPE + SSMax",
    "rope-nope-every-4th-temp128": "RoPE (NoPE every 4th layer, Llama 4's temperature from 128 keys)",
    "rope-nope-every-2nd-temp16": "RoPE (NoPE every 2nd layer, Llama 4's temperature from 16 keys)",
}
AT_EVALUATION: dict[str, tuple[str, str]] = {
    f"{pe}-{method}": (pe, method) for pe in ("rope", "tape") for method in ("ntk", "dynamic", "yarn")
}
"""Rows evaluated, not trained: the trained model of the row named first under a RoPE scaling applied at evaluation
(`experiments.scaling`: NTK-aware, dynamic NTK, YaRN), as users run RoPE beyond its training length; paired by seed
with the same models. TAPE's rows scale its initial rotation E0."""
ROPE_FAMILY_NAMES.update(
    {
        f"{pe}-{method}": f"{'RoPE' if pe == 'rope' else 'TAPE'} + {label} at evaluation"
        for pe in ("rope", "tape")
        for method, label in (("ntk", "NTK-aware"), ("dynamic", "dynamic NTK"), ("yarn", "YaRN"))
    }
)
MECHANISMS = {**ROPE_FAMILY, **WITH_ATTENTION_OPTIONS}
"""Every row spelled as an encoding plus options that is reported as an encoding of its own."""
ATTENTION_OPTION_FIELDS = ("ssmax", "attention_gate", "nope_temperature_tuning", "nope_floor_scale")


def with_attention_options(name: str) -> bool:
    """Whether `name` is a row with an option of the attention on: a `WITH_ATTENTION_OPTIONS` row or a gated one."""
    return name in WITH_ATTENTION_OPTIONS or gated_row(name) is not None


def without_attention_options(name: str) -> str:
    """The row a row with options of the attention on is paired with: the same encoding and options, the attention's
    left out (e.g. "path-gated" -> "path", "rope-nope-every-4th-temp128" -> "rope-nope-every-4th")."""
    pe, options = WITH_ATTENTION_OPTIONS.get(name) or gated_row(name) or (name, {})
    rest = {key: value for key, value in options.items() if key not in ATTENTION_OPTION_FIELDS}
    if not rest:
        return pe
    return next(row for row, spec in ROPE_FAMILY.items() if spec == (pe, rest))


def check_row(name: str) -> None:
    """Refuse a name that is neither an encoding nor a variant, listing both."""
    known = is_registered(name) or name in VARIANTS or name in MECHANISMS or name in AT_EVALUATION
    if not known and gated_row(name) is None:
        raise ValueError(
            f"unknown encoding '{name}'; choose from: {', '.join([*encoding_names(), *MECHANISMS])}, any encoding "
            f"gated (its name + '{GATED_SUFFIX}'), a row evaluated from another's models: {', '.join(AT_EVALUATION)}, "
            f"or a variant: {', '.join(VARIANTS)}"
        )


def display_name(name: str) -> str:
    """The name reports give an encoding (its own `display_name`), a RoPE-family row, a gated row, or any other row
    (itself)."""
    if gated := gated_row(name):
        return f"{registered_display_name(gated[0])}, gated attention"
    return ROPE_FAMILY_NAMES.get(name) or registered_display_name(name)


def trained_row(name: str) -> str:
    """The row whose trained models `name` uses: its own, or for an `AT_EVALUATION` row the row it evaluates."""
    return AT_EVALUATION[name][0] if name in AT_EVALUATION else name


def resolve_variant(name: str) -> tuple[str, dict[str, Any]]:
    """(pe_type, TapeConfig options) of an encoding or variant name (an encoding is itself with no options)."""
    return VARIANTS.get(name) or MECHANISMS.get(name) or gated_row(name) or (name, {})


__all__ = [
    "ABLATIONS",
    "AT_EVALUATION",
    "ATTENTION_OPTION_FIELDS",
    "GATE",
    "GATED_SUFFIX",
    "MECHANISMS",
    "ROPE_FAMILY",
    "ROPE_FAMILY_NAMES",
    "WITH_ATTENTION_OPTIONS",
    "VARIANTS",
    "check_row",
    "display_name",
    "gated_row",
    "resolve_variant",
    "trained_row",
    "with_attention_options",
    "without_attention_options",
]
