"""Per-layer position schedules: each decoder layer's own encoding (`layer_pe_types`).

`layer_encodings` spells out the encoding of every layer: `layer_pe_types` (a list of registered `pe_type`s, one per
layer, or a preset applied to `pe_type`), or RoPE's older `rope_layers` as the RoPE/NoPE schedule it means. A
`Schedule` builds each distinct encoding's model-level module once and gives each its own `PositionContext` view (its
own `tables` and `bias`), so that a layer sees exactly what the model of its encoding would show it; the positional
state is the one its stateful member carries (TAPE's E), passed unchanged through the other layers.

A mix of encodings may only hold encodings that act inside the layers: one that adds to the input embeddings
(learned, sinusoidal) or changes the positions (RandPE) does so for every layer, so it is refused in a mix.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .base import LayerPositional, PositionalEncoding, PositionContext, check_choice

PRESETS = {"nope-every-4th": 4, "nope-every-2nd": 2}
"""Preset -> k: every k-th layer (the k-th, 2k-th, ...) is NoPE, the others use `pe_type`. "nope-every-4th" is
SmolLM3's and Llama 4's placement (`no_rope_layer_interval` 4; Llama 4's NoPE layers also scale their logits:
`nope_temperature_tuning`); "nope-every-2nd" interleaves NoPE and `pe_type`
layers one to one (RNoPE's interleaving, without its sliding window: docs/ENCODINGS.md)."""
ROPE_LAYER_SCHEDULES = ("all", "nope-every-4th")


def is_scheduled(config) -> bool:
    """Whether the layers' encodings come from a schedule rather than `pe_type` alone."""
    return config.layer_pe_types is not None or config.rope_layers != "all"


def layer_encodings(config) -> list[str]:
    """The `pe_type` of every decoder layer, in order."""
    layers = range(config.num_hidden_layers)
    schedule = config.layer_pe_types
    if schedule is None and config.rope_layers != "all":  # RoPE's own spelling: a preset, or the layers that rotate
        rotating = config.rope_layers
        schedule = rotating if isinstance(rotating, str) else ["rope" if i in rotating else "nope" for i in layers]
    if schedule is None:
        return [config.pe_type] * len(layers)
    if isinstance(schedule, str):
        return ["nope" if (i + 1) % PRESETS[schedule] == 0 else config.pe_type for i in layers]
    return list(schedule)


def encodings_in(config) -> tuple[str, ...]:
    """The distinct encodings of a config's layers, in order of first use."""
    return tuple(dict.fromkeys(layer_encodings(config)))


def acts_outside_layers(encoding: type[PositionalEncoding]) -> str | None:
    """What an encoding changes for every layer at once ("the input embeddings", "the positions"), or None."""
    if encoding.embed is not PositionalEncoding.embed:
        return "the input embeddings"
    if encoding.positions is not PositionalEncoding.positions:
        return "the positions"
    return None


def validate_schedule(config, registry: dict[str, type[PositionalEncoding]]) -> None:
    """Raise ValueError naming a bad `layer_pe_types` or `rope_layers`, or a mix of encodings that cannot share the
    layers of one model."""
    layers, schedule = config.num_hidden_layers, config.layer_pe_types
    if isinstance(schedule, str):
        check_choice("layer_pe_types", schedule, tuple(PRESETS))
    elif schedule is not None:
        if not isinstance(schedule, (list, tuple)) or len(schedule) != layers:
            raise ValueError(
                f"layer_pe_types={schedule!r} is not allowed; give one of: {', '.join(PRESETS)}, or a list of "
                f"num_hidden_layers={layers} registered pe_types"
            )
        for i, name in enumerate(schedule):
            check_choice(f"layer_pe_types[{i}]", name, tuple(registry))
    check_rope_layers(config)
    names = encodings_in(config)
    if len(names) > 1:
        for name in names:
            acts = acts_outside_layers(registry[name])
            if acts is not None:
                allowed = [other for other, cls in registry.items() if acts_outside_layers(cls) is None]
                raise ValueError(
                    f"layer_pe_types mixes {name!r}, which changes {acts} of every layer; a mix allows only: "
                    f"{', '.join(allowed)}"
                )


def check_rope_layers(config) -> None:
    """`rope_layers`, RoPE's own RoPE/NoPE schedule: a preset or distinct layer indices, with pe_type "rope" and no
    `layer_pe_types`."""
    schedule, layers = config.rope_layers, config.num_hidden_layers
    if isinstance(schedule, str):
        check_choice("rope_layers", schedule, ROPE_LAYER_SCHEDULES)
    elif (
        not isinstance(schedule, (list, tuple))
        or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in schedule)
        or len(set(schedule)) != len(schedule)
    ):
        raise ValueError(
            f"rope_layers={schedule!r} is not allowed; give one of {', '.join(ROPE_LAYER_SCHEDULES)} or a list of "
            f"distinct layer indices from 0 to {layers - 1}"
        )
    if schedule != "all" and config.pe_type != "rope":
        raise ValueError(f"rope_layers={schedule!r} is an option of pe_type='rope', not of pe_type={config.pe_type!r}")
    if schedule != "all" and config.layer_pe_types is not None:
        raise ValueError(
            f"rope_layers={schedule!r} and layer_pe_types={config.layer_pe_types!r} both schedule the layers; "
            "give layer_pe_types only"
        )


class Schedule(PositionalEncoding):
    """The model level of a per-layer schedule: each distinct encoding built once (`encodings`, by name), each with
    its own context view; the model-level flags are the strictest of its members'."""

    def __init__(self, config, registry: dict[str, type[PositionalEncoding]]):
        super().__init__()
        self.layer_names = layer_encodings(config)
        self.encodings = nn.ModuleDict({name: registry[name](config) for name in encodings_in(config)})
        members = list(self.encodings.values())
        self.needs_key_positions = any(member.needs_key_positions for member in members)
        self.adds_logit_bias = any(member.adds_logit_bias for member in members)
        self.fixed_shape_cache = all(member.fixed_shape_cache for member in members)
        self.causal_only = any(member.causal_only for member in members)

    def positions(
        self,
        position_ids: torch.Tensor,
        past: int = 0,
        documents: torch.Tensor | None = None,
        extent: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """The members' positions (only a schedule of one encoding may change them: `validate_schedule`)."""
        for member in self.encodings.values():
            position_ids = member.positions(position_ids, past, documents, extent)
        return position_ids

    def prepare(self, ctx: PositionContext, dtype: torch.dtype) -> None:
        """Each member prepares a view of its own; every layer reads its encoding's."""
        views = {}
        for name, member in self.encodings.items():
            views[name] = dataclasses.replace(ctx, tables={}, bias=None, layer_views=None)
            member.prepare(views[name], dtype)
        ctx.layer_views = tuple(views[name] for name in self.layer_names)

    def embed(self, hidden: torch.Tensor, ctx: PositionContext) -> torch.Tensor:
        for name, member in self.encodings.items():
            hidden = member.embed(hidden, self._view(ctx, name))
        return hidden

    def initial_state(self, ctx: PositionContext, dtype: torch.dtype):
        """The state of the member that carries one (TAPE's), or None."""
        for name, member in self.encodings.items():
            state = member.initial_state(self._view(ctx, name), dtype)
            if state is not None:
                return state
        return None

    def make_layer(self, layer_idx: int) -> LayerPositional:
        return self.encodings[self.layer_names[layer_idx]].make_layer(layer_idx)

    def _view(self, ctx: PositionContext, name: str) -> PositionContext:
        return ctx.layer_views[self.layer_names.index(name)]
