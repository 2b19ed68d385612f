"""Named model variants that experiments compare like encodings: TAPE's ablations (the paper's table and the
official code's switches). A variant is a `pe_type` plus TapeConfig options; `tapelm compare --pe tape-mlp-only ...`
and `tapelm ablate TASK` use these names as rows, and every variant of one comparison shares its budget."""

from __future__ import annotations

from typing import Any

from .config import PE_TYPES

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


def check_encoding(name: str) -> None:
    """Refuse a name that is neither an encoding nor a variant, listing both."""
    if name not in PE_TYPES and name not in VARIANTS:
        raise ValueError(
            f"unknown encoding '{name}'; choose from: {', '.join(PE_TYPES)}, or a variant: {', '.join(VARIANTS)}"
        )


def resolve_variant(name: str) -> tuple[str, dict[str, Any]]:
    """(pe_type, TapeConfig options) of an encoding or variant name (an encoding is itself with no options)."""
    return VARIANTS.get(name, (name, {}))


__all__ = ["ABLATIONS", "VARIANTS", "check_encoding", "resolve_variant"]
