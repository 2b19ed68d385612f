"""The questions the decoder asks a positional encoding; every answer defaults to "nothing".

An encoding is two modules. The model-level `PositionalEncoding` works once per forward pass: it may add to the
input embeddings, precompute what its layers need (rotation tables, a shared logit bias) and provide an initial
positional state. Its `make_layer` builds one `LayerPositional` per decoder block, which may transform q and k, add a
per-layer logit bias or compute the attention itself, append a positional state to the value stream and update that
state after the attention and MLP sublayers. The decoder block calls these hooks and never names an encoding. An
encoding whose model level only makes its layers is a `PerLayerEncoding` naming its layer class.

This module is the contract of every encoding, tapelm's own and anyone's (`register_encoding`):

- **Must implement**: `__init__(config)` of the model level (a `PerLayerEncoding` has it, and names `layer_class`,
  built as `layer_class(config, layer_idx)`). Nothing else: every hook below defaults to "nothing".
- **May override**: the model level's `positions`, `embed`, `prepare`, `initial_state`, `make_layer`,
  `validate_fields`, `validate_config`; the layer's `transform_qk`, `logit_bias`, `attention_inputs`, `attend`,
  `value_extra`, `after_attention`, `after_mlp`, `logit_scale`, `logit_length`, and `init_weights` of any
  `CustomInit` module.
- **What the decoder guarantees**:
  - positions: `ctx.query_positions` (B, N) are the new tokens' positions as `positions` returned them, taken from
    `position_ids` when given, else counted over the real tokens of a left-padded row, else 0..N-1 after the cached
    tokens; `ctx.key_positions` (B, T), every key's including the cached ones, when `needs_key_positions`;
  - a cache: the hooks see only the new tokens; the default `attention_inputs` stores the transformed keys and the
    value stream and hands attention every key, so that decoding step by step computes the full pass;
  - padding: `ctx.token_mask` marks the real tokens (None: none padded), and no query attends to a padding key;
  - packed documents (positions restarting inside a row, or `cu_seq_lens`): `positions` receives the documents, and
    the mask keeps every token inside its own document;
  - devices and dtypes: the hooks receive tensors on the model's device, q and k in the compute dtype; angles and
    whatever else a position feeds should be computed in float32 or wider (`Float32Buffers` keeps tables there).
- **Declares**: its facts, on the class (`PositionalEncoding`'s docstring). `tapelm.testing` checks the
  guarantees' consequences for any encoding: `tapelm check-encoding NAME`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..cache import store_keys_values
from ..fast_paths import FastPaths
from ..kernels.attention import AttentionMask


def check_choice(field: str, value, allowed) -> None:
    """A config field's value must be one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"{field}={value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")


def check_positive(field: str, value) -> None:
    """A config field's value must be a positive integer."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{field}={value!r} is not allowed; it must be a positive integer")


def check_positive_number(field: str, value) -> None:
    """A config field's value must be a finite positive number."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{field}={value!r} is not allowed; it must be a positive number")


def check_bool(field: str, value) -> None:
    """A config field's value must be True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"{field}={value!r} is not allowed; it must be True or False")


@dataclass
class PositionContext:
    """What a forward pass knows about positions, computed once and read by every layer.

    `query_positions` (batch, N) are the positions of the new tokens, `key_positions` (batch, T) those of every key
    including the cached ones (only filled when the encoding asks for them). `paths` are the fast paths on for this
    pass (`tapelm.fast_paths.resolve`): every hook with a fast path hands them to its operation's dispatcher.
    `tables` holds whatever the encoding
    precomputed (e.g. cos/sin), `bias` an optional additive logit bias (batch or 1, heads, N, T) shared by all layers
    (a tensor or a `tapelm.kernels.attention.RowBias`).
    `token_mask` (batch, N) is True for the new tokens that are real and False for padding (None: no padding), so
    that per-token state (FoX's forget gates, PaTH's convolution) can ignore padding tokens.
    `layer_views`, set by a per-layer schedule (`tapelm.positional.schedule`): each layer's own view of the context
    (its encoding's `tables` and `bias`); None: every layer reads this one (`for_layer`).
    `distinct_rows`, when the host knew them (no cached tokens): the first row of each distinct row of the positions
    the model gave the tokens (in sorted order; before RandPE resamples them) and each row's index among them.
    """

    query_positions: torch.Tensor
    paths: FastPaths
    key_positions: torch.Tensor | None = None
    tables: dict[str, torch.Tensor] = field(default_factory=dict)
    bias: torch.Tensor | None = None
    token_mask: torch.Tensor | None = None
    distinct_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    layer_views: tuple[PositionContext, ...] | None = None

    def for_layer(self, layer_idx: int) -> PositionContext:
        """The context decoder layer `layer_idx` reads."""
        return self if self.layer_views is None else self.layer_views[layer_idx]


class Float32Buffers(nn.Module):
    """Keeps float32 buffers (frequencies, slopes) in float32 when the model is cast to bf16 or fp16: positions and
    angles computed from rounded frequencies are wrong far beyond a few hundred tokens."""

    def _apply(self, fn, recurse=True):
        kept = {name: buf for name, buf in self._buffers.items() if buf is not None and buf.dtype == torch.float32}
        super()._apply(fn, recurse)
        for name, buf in kept.items():  # only a cast is undone: `to_empty` from the meta device changes no dtype
            if self._buffers[name].dtype != torch.float32:
                self._buffers[name] = buf.to(self._buffers[name].device)
        return self


class CustomInit(nn.Module):
    """A module whose own tensors start at values other than transformers' defaults for their module types.

    `init_weights(init, std)` sets them (with `transformers.initialization`, which skips tensors already loaded).
    It must set the tensors this module holds itself, not those of its children: transformers initialises only
    the modules that hold an uninitialised tensor directly (a checkpoint that lacks it, meta-device
    initialisation), and skips a module without tensors of its own. A child with its own initial values is a
    `CustomInit` too."""

    def init_weights(self, init, std: float) -> None:
        """Set this module's own tensors; `std` is the config's initializer_range."""


class LayerPositional(CustomInit):
    """Per-layer hooks. The defaults leave attention untouched and carry no state.

    `logit_length`: None, or a module mapping the number of keys each query sees, (B or 1, 1, N, 1) in float32, to a
    factor on that query's logits, broadcastable to (B, H, N, 1) (Llama 4's temperature on NoPE layers); the decoder
    multiplies q and the query's row of the logit bias by it."""

    def __init__(self):
        super().__init__()
        self.logit_length: nn.Module | None = None

    def transform_qk(self, q: torch.Tensor, k: torch.Tensor, state, ctx: PositionContext):
        """Return q, k as the attention logits should see them; q (B, H, N, d), k (B, Hkv, N, d)."""
        return q, k

    def logit_bias(self, q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor | None, ctx: PositionContext):
        """An extra additive bias (B, H, N, T) computed from q and all keys, or None: a tensor, or a
        `tapelm.kernels.attention.RowBias` that builds it for any block of queries (so attention need not keep all
        of it).
        `valid` is the boolean mask."""
        return None

    def attention_inputs(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        stream: torch.Tensor,
        value_width: int,
        cache,
        layer_idx: int,
        valid: torch.Tensor | None,
        ctx: PositionContext,
    ):
        """Store the new keys and value stream in the cache (when there is one) and return what attention reads:
        q (B, H, N, d), every key (B, Hkv, T, d), every value (B, Hkv, T, F) and this layer's additive logit bias
        (B, H, N, T) or None. `x` (B, N, C) is the layer's attention input (after the norm); the first `value_width`
        features of the stream are V.

        The default caches k and the stream and asks `logit_bias`. Encodings that keep per-token state of their own
        (FoX's cumulative forget gates, PaTH's transformed keys and convolution inputs) override this and keep that
        state in the cache too (see `tapelm.cache.store_state`), so cropping, beam reordering and batch selection
        treat it like the keys."""
        k, stream = store_keys_values(cache, layer_idx, k, stream, value_width)
        return q, k, stream, self.logit_bias(q, k, valid, ctx)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        stream: torch.Tensor,
        shared: torch.Tensor | None,
        mask: AttentionMask,
        scale: float,
        ctx: PositionContext,
        probabilities: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Compute this layer's attention itself, for attention that is no softmax of logits plus a bias
        (stick-breaking), or None (the default): the decoder's softmax attention.

        Called with what `attention_inputs` returned (every key, cached ones included): q (B, H, N, d),
        k (B, Hkv, T, d), the value stream (B, Hkv, T, F) and `shared` (B, 1, T, F'), the rest of the stream the same
        for every KV head, or None (`tapelm.kernels.attention.joined_stream` joins them), with the mask and
        `logit_scale`. Returns the output of the whole stream (B, H, N, F + F') and, when `probabilities`
        (`output_attentions=True`), the weights (B, H, N, T) it mixed the stream with (else None). An encoding that
        attends itself adds no logit bias; a function registered with transformers' `AttentionInterface` cannot
        stand in for it (the decoder refuses one)."""
        return None

    def value_extra(self, state) -> torch.Tensor | None:
        """A tensor (B, Hkv, N, F) that the attention probabilities should mix alongside V, or None."""
        return None

    def after_attention(self, state, attended: torch.Tensor | None, ctx: PositionContext):
        """The state after the attention sublayer. `attended` (B, H, N, F) is the attention output of the features
        value_extra added to the value stream (None when it gave nothing)."""
        return state

    def after_mlp(self, state, mlp_out: torch.Tensor, ctx: PositionContext):
        """The state after the MLP sublayer; `mlp_out` (B, N, C) is what the MLP added to the residual stream."""
        return state

    def logit_scale(self, head_dim: int) -> float:
        """The softmax temperature: 1/sqrt(head_dim) unless the q/k transform changes the dot-product's size."""
        return head_dim**-0.5


FAMILIES = ("accumulating", "decaying")
"""The far-lengths question's families: encodings that accumulate position along the sequence (a running product of
transforms carries positions along: TAPE, PaTH, GRAPE-M, Selective RoPE) against those whose attention decays with
distance or gates (FoX, stick-breaking, Wall, ALiBi, GRAPE-A, GRAPE-AP)."""


@dataclass(frozen=True)
class StepCost:
    """A training step's time on a GPU against RoPE's at the bench's size (`tapelm bench speed --device cuda`):
    `measured` on GPUs, or estimated without one; `source` says where the number comes from."""

    ratio: float
    measured: bool
    source: str


class PositionalEncoding(CustomInit):
    """Model-level hooks. The defaults add nothing, need no key positions and carry no state.

    What the decoder needs to know:
    `needs_key_positions`: the context must carry the positions of every key (relative biases).
    `adds_logit_bias`: attention needs an explicit mask because logits get a float bias.
    `fixed_shape_cache`: the layers can read a static cache's whole buffers, unwritten rows masked (False: they need
    the cached tokens as a sequence, as PaTH's transforms do).
    `causal_only`: the positional signal only runs from earlier to later tokens, so `causal=False` is refused.
    `validate_fields` and `validate_config` check the encoding's own config fields at `TapeConfig`'s construction.

    The facts the lab and the conformance kit read (declared once, here on the class):
    `display_name`: the encoding's name in reports (None: its registered name); a class's own, never inherited.
    `relative`: True when the model reads only the differences of the positions it is given (adding one number to
    every position changes nothing), False when it reads their values (absolute); `tapelm.testing` holds the
    encoding to it.
    `family`: its answer to the far-lengths question (`tapelm.experiments.lengths`): "accumulating" (a running
    product of transforms carries positions along), "decaying" (attention decays with distance or gates) or None.
    `step_cost`: a `StepCost`, or None where nothing is known (the GPU budget then prices it at the largest cost).
    `config_fields`: the encoding's own config fields and their defaults, for an encoding whose fields are not
    declared on `TapeConfig` (a plugin's): every config carries them, so that config.json saves them.
    `test_options`: config values that make the kit's tiny model deterministic and small (e.g. FIRE's width).
    `softmax_of_logits`: its attention is the decoder's softmax of q.k plus a bias, so that options acting on the
    logits (SSMax) apply; False for one whose layers compute their attention themselves (`LayerPositional.attend`).
    `rope_scaling`: it rotates by transformers' RoPE spectrum under the scaling `rope_parameters` names (linear,
    YaRN, dynamic, ...); a config whose layers hold no such encoding refuses a scaling, which would change nothing.
    `reads_position_limit`: its model depends on `max_position_embeddings` or `randpe_max_position`, which the
    experiments size to the longest evaluation length (a learned table, RandPE's range, xPos's centre). True, the
    safe default, keys a run's training on them; False lets runs that differ only in their evaluation share one
    training (`tapelm.experiments.runs.training_identity`), and the kit holds the encoding to it.
    """

    needs_key_positions = False
    adds_logit_bias = False
    fixed_shape_cache = True
    causal_only = False

    display_name: str | None = None
    relative: bool = True
    family: str | None = None
    step_cost: StepCost | None = None
    config_fields: dict = {}
    test_options: dict = {}
    softmax_of_logits: bool = True
    rope_scaling: bool = False
    reads_position_limit: bool = True

    @classmethod
    def validate_fields(cls, config) -> None:
        """Raise ValueError naming the first of this encoding's own config fields whose value is not allowed (and
        put a field in its canonical form where it has one). Called for every registered encoding on every config,
        whatever its `pe_type`: a config carries and saves every encoding's fields."""

    @classmethod
    def validate_config(cls, config) -> None:
        """Raise ValueError naming a field or combination this encoding cannot run with (its fields against the
        model's sizes); called when `config.pe_type` names it."""

    def positions(
        self,
        position_ids: torch.Tensor,
        past: int = 0,
        documents: torch.Tensor | None = None,
        extent: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """The positions this encoding actually uses for tokens following `past` cached ones (RandPE resamples
        them); `documents` (B, N) numbers the packed documents of each row (None: one per row); `extent`, the
        documents of the fullest row and 1 + the largest of `position_ids`, when the host knew them (None: read them
        from the tensors where needed)."""
        return position_ids

    def embed(self, hidden: torch.Tensor, ctx: PositionContext) -> torch.Tensor:
        """The input embeddings with any absolute position signal added."""
        return hidden

    def prepare(self, ctx: PositionContext, dtype: torch.dtype) -> None:
        """Fill `ctx.tables` and `ctx.bias` for this forward pass."""

    def initial_state(self, ctx: PositionContext, dtype: torch.dtype):
        """The positional state entering the first layer, or None."""
        return None

    def make_layer(self, layer_idx: int) -> LayerPositional:
        """The per-layer hooks for decoder block `layer_idx`."""
        return LayerPositional()


class PerLayerEncoding(PositionalEncoding):
    """An encoding whose model level only makes its layers: every hook lives in `layer_class`, built as
    `layer_class(config, layer_idx)` for each decoder block. A subclass names its layer class (and sets the model-level
    flags it needs, e.g. `adds_logit_bias`)."""

    layer_class: type[LayerPositional]

    def __init__(self, config):
        super().__init__()
        self.config = config

    def make_layer(self, layer_idx: int) -> LayerPositional:
        return self.layer_class(self.config, layer_idx)
