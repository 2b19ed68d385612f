"""Rotary encodings: RoPE (with transformers' scalings), RandPE and xPos.

Angles are computed in float32 from integer positions whatever the model dtype, and use transformers' rotate-half
pairing (dimension i pairs with i + head_dim/2), so weights of a Llama-family model mean the same thing here. The
table of a forward pass (`ctx.tables["angles"]`, (B or 1, 1, N, head_dim)) holds one cos and one sin per pair,
[cos | sin] (the two halves of transformers' tables are equal): the layout of TAPE's state, which rotates q and k
the same way (`tapelm.kernels.rotation`); xPos's keys have their own (`"key_angles"`).

tapelm computes RoPE's frequencies here only: `rope_frequencies` (the default spectrum from theta, as transformers'
default RoPE computes it, on a given device; GRAPE-M starts its learnable spectrum from it) and `TapeRotaryEmbedding`
(transformers' spectrum under its scalings, and TAPE's groups of it).
"""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import dynamic_rope_update
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from ..kernels.rotation import rotate_queries_and_keys
from .base import (
    Float32Buffers,
    LayerPositional,
    PositionalEncoding,
    PositionContext,
    check_choice,
    check_positive,
    check_positive_number,
)
from .costs import measured
from .schedule import encodings_in

RANDPE_EVAL_POSITIONS = ("random", "given")


def check_even_head_dim(config) -> None:
    """A rotary encoding rotates pairs of dimensions: head_dim must be even."""
    if config.head_dim % 2:
        raise ValueError(f"head_dim={config.head_dim} must be even for the rotary encoding pe_type={config.pe_type!r}")


def group_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """View queries (B, H, N, d) as (B, Hkv, H/Hkv, N, d) so that a per-KV-head table broadcasts over its group."""
    batch, heads, length, dim = q.shape
    return q.view(batch, kv_heads, heads // kv_heads, length, dim)


def rope_frequencies(theta: float, dim: int, device: torch.device | None = None) -> torch.Tensor:
    """RoPE's inverse frequencies theta ** (-2i / dim) for i < dim / 2, in float32 on `device`, computed as
    transformers' default RoPE computes them (1 / theta ** (2i / dim)), which is what `TapeRotaryEmbedding` holds for
    rope_type "default"."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)


class TapeRotaryEmbedding(Float32Buffers, LlamaRotaryEmbedding):
    """transformers' rotary embedding (its scalings, dynamic updates and re-initialisation), with cos/sin computed in
    float32, or float64 for a float64 model, from integer positions. With `rope_fraction` p < 1 (p-RoPE) only the
    `rotating_pairs` highest frequencies rotate, floor(p x head_dim / 2) of them, counted as transformers'
    `rope_type="proportional"` counts them: the lowest ones have angle 0."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.rotating_pairs = int(config.rope_fraction * config.head_dim // 2)

    def grouped_frequencies(self, groups: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """(groups, head_dim/2) in `dtype`: the (scaled) inverse frequencies, group g's times
        theta ** (-2g / (groups * head_dim)), so that the groups interleave as the spectrum of a head `groups` times
        wider (TAPE's E0 with R = groups x L)."""
        offsets = torch.arange(groups, dtype=dtype, device=device)
        group_freq = self.config.rope_parameters["rope_theta"] ** (-2.0 * offsets / (groups * self.config.head_dim))
        return group_freq[:, None] * self.inv_freq.to(device, dtype)

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, anchor: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, N) integer positions -> cos, sin (B, N, head_dim/2), one per rotate-half pair, in the anchor's
        precision, at least float32."""
        wide = torch.promote_types(anchor.dtype, torch.float32)
        frequencies = self.inv_freq.to(device=positions.device, dtype=wide)
        if self.rotating_pairs < frequencies.shape[-1]:  # p-RoPE: the lowest frequencies do not rotate
            frequencies = frequencies * (
                torch.arange(frequencies.shape[-1], device=positions.device) < self.rotating_pairs
            )
        angles = positions[..., None].to(wide) * frequencies
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self(torch.empty(0, dtype=dtype, device=positions.device), positions)


class RotaryLayer(LayerPositional):
    """Rotate q and k with the tables the model-level encoding prepared."""

    def transform_qk(self, q, k, state, ctx: PositionContext):
        return rotate_queries_and_keys(q, k, ctx.tables["angles"], ctx.paths, ctx.tables.get("key_angles"))


class RoPE(PositionalEncoding):
    """Rotary position embedding (Su et al. 2021) with any scaling transformers supports."""

    reads_position_limit = False
    display_name = "RoPE"
    step_cost = measured(1.0)
    rope_scaling = True

    def __init__(self, config):
        super().__init__()
        self.rotary = TapeRotaryEmbedding(config)

    @classmethod
    def validate_fields(cls, config) -> None:
        fraction = config.rope_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise ValueError(
                f"rope_fraction={fraction!r} is not allowed; give the share of RoPE's frequencies that rotate "
                "(p-RoPE), from 0 to 1"
            )
        if fraction != 1 and "rope" not in encodings_in(config):
            raise ValueError(
                f"rope_fraction={fraction!r} is an option of pe_type='rope' (p-RoPE), not of pe_type={config.pe_type!r}"
            )

    @classmethod
    def validate_config(cls, config) -> None:
        check_even_head_dim(config)

    def prepare(self, ctx: PositionContext, dtype: torch.dtype) -> None:
        ctx.tables["angles"] = torch.cat(self.rotary.tables(ctx.query_positions, dtype), dim=-1)[:, None].to(dtype)

    def make_layer(self, layer_idx: int) -> LayerPositional:
        return RotaryLayer()


class RandPE(RoPE):
    """Randomised positions (Ruoss et al. 2023): positions become a sorted random subset of [0, randpe_max_position),
    drawn afresh in every forward pass, in training and (with `randpe_eval_positions` "random", the default) at
    evaluation, so that test positions come from the distribution the model was trained on; "given" evaluates on the
    given positions. See `TapeConfig` for the sources and for the one difference to both reference codes (one draw
    per forward pass, shared by all layers)."""

    reads_position_limit = True  # positions drawn from [0, randpe_max_position)
    display_name = "RandPE"
    step_cost = measured(1.0)  # it rotates like RoPE
    test_options = {"randpe_eval_positions": "given"}  # the given positions: deterministic

    def __init__(self, config):
        super().__init__(config)
        self.max_position = config.randpe_max_position
        self.random_at_eval = config.randpe_eval_positions == "random"

    @classmethod
    def validate_fields(cls, config) -> None:
        check_choice("randpe_eval_positions", config.randpe_eval_positions, RANDPE_EVAL_POSITIONS)
        check_positive("randpe_max_position", config.randpe_max_position)
        if config.randpe_max_position < config.max_position_embeddings:
            raise ValueError(
                f"randpe_max_position={config.randpe_max_position} must be >= "
                f"max_position_embeddings={config.max_position_embeddings}"
            )

    def positions(
        self,
        position_ids: torch.Tensor,
        past: int = 0,
        documents: torch.Tensor | None = None,
        extent: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Each packed document (each row, without packing) draws its own subset, sized by its own largest position,
        so that it gets the positions it would get alone (in distribution)."""
        if not (self.training or self.random_at_eval):
            return position_ids
        if past:
            raise ValueError(
                "RandPE draws new random positions in every forward pass, so it cannot continue a cache; "
                "pass use_cache=False, or set randpe_eval_positions='given' to decode with a cache"
            )
        position_ids = position_ids.clamp(min=0)
        documents = torch.zeros_like(position_ids) if documents is None else documents
        count = int(documents.max()) + 1 if extent is None else extent[0]
        needed = position_ids.new_zeros(position_ids.shape[0], count).scatter_reduce(
            1, documents, position_ids + 1, "amax"
        )  # (B, documents)
        most = int(needed.max()) if extent is None else max(extent[1], 1)
        if most > self.max_position:
            raise ValueError(f"RandPE needs {most} distinct positions but randpe_max_position={self.max_position}")
        scores = torch.rand(*needed.shape, self.max_position, device=position_ids.device)
        drawn = scores.topk(most, dim=-1).indices  # in random order: a document's first `needed` are its subset
        unused = torch.arange(most, device=drawn.device) >= needed[..., None]
        subsets = drawn.masked_fill(unused, self.max_position).sort(dim=-1).values
        return subsets.flatten(1).gather(1, documents * most + position_ids)


class XPos(RoPE):
    """xPos (Sun et al. 2022): RoPE whose frequency pairs also decay as zeta_b ** ((i - j) / scale_base).

    q is scaled by zeta ** (t - c) / scale_base and k by its inverse, with a fixed centre c =
    max_position_embeddings // 2 so that cached keys stay valid and the factors stay in range. zeta_b =
    (b / (d/2) + 0.4) / 1.4 and the default `xpos_scale_base` 2048 are the paper's official code's
    (VITA-Group/TAPE, models/llama/xpos.py, `XposRotaryEmbedding(scale_base=2048)`)."""

    reads_position_limit = True  # its decay's centre: max_position_embeddings // 2
    display_name = "xPos"
    step_cost = measured(0.99)

    def __init__(self, config):
        super().__init__(config)
        self.head_dim = config.head_dim
        self.scale_base = config.xpos_scale_base
        self.centre = config.max_position_embeddings // 2

    @classmethod
    def validate_fields(cls, config) -> None:
        check_positive_number("xpos_scale_base", config.xpos_scale_base)

    def prepare(self, ctx: PositionContext, dtype: torch.dtype) -> None:
        cos, sin = self.rotary.tables(ctx.query_positions, dtype)
        power = (ctx.query_positions.to(cos.dtype) - self.centre)[..., None] / self.scale_base
        half = self.head_dim // 2
        scale = ((torch.arange(half, dtype=power.dtype, device=power.device) / half + 0.4) / 1.4) ** power
        ctx.tables.update(
            angles=torch.cat([cos * scale, sin * scale], dim=-1)[:, None].to(dtype),
            key_angles=torch.cat([cos / scale, sin / scale], dim=-1)[:, None].to(dtype),
        )
