"""The decoder: one Llama-style skeleton for every positional encoding, Hugging Face-native."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.utils import can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg

from .attention_options import OutputGate, ScalableSoftmax
from .cache import (
    SHARED_STREAM,
    capacity,
    check_cache_type,
    check_room,
    has_fixed_shapes,
    key_positions,
    prepare_cache,
    store_state,
)
from .config import TapeConfig
from .fast_paths import FastPaths, resolve
from .kernels.attention import (
    AttentionMask,
    RowBias,
    attend_registered,
    attend_stream,
    attend_with_probabilities,
    joined_stream,
    scale_rows,
)
from .kernels.loss import loss_without_logits
from .kernels.mlp import swiglu
from .kernels.norm import rms_norm
from .layout import TokenLayout
from .masks import build_attention_mask, packed_documents, real_tokens, tracing
from .positional import CustomInit, LayerPositional, PositionContext, TapeLayer, build_encoding, encodings_in

logger = logging.get_logger(__name__)


TAPELM_ATTENTION = ("sdpa", "eager")
"""`attn_implementation`s that are tapelm's own attention: "sdpa" (SDPA and the fast paths), "eager" (the explicit
reference). Any other name a model takes is a function registered with transformers' `AttentionInterface`."""


class TapeAttention(nn.Module):
    """Multi-head attention with GQA; the positional hooks decide how q, k, the logits and the values look.

    The config's `attn_implementation` chooses how q, k, the value stream, the mask and the bias become the output:
    tapelm's own attention ("sdpa", or "eager" for the explicit reference), or a function registered under that name
    with transformers' `AttentionInterface` (`tapelm.kernels.attention.attend_registered` says how it is called).
    A layer whose positional module computes the attention itself (`LayerPositional.attend`) takes tapelm's own
    attention only. `ssmax` and `attention_gate` (`tapelm.attention_options`) scale the logits by the number of keys
    each query sees and gate the heads' outputs, whatever the encoding."""

    def __init__(self, config: TapeConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.config = config
        self.is_causal = config.causal
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        bias = config.attention_bias or config.qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias
        )
        self.ssmax = ScalableSoftmax(config) if config.ssmax else None
        self.output_gate = OutputGate(config) if config.attention_gate else None

    def forward(
        self,
        hidden,
        positional: LayerPositional,
        state,
        ctx: PositionContext,
        mask: AttentionMask,
        cache: Cache | None,
        layout: TokenLayout,
        output_attentions: bool = False,
    ):
        """`hidden` holds the tokens as `layout` lays them out. Returns the sublayer output (same layout); when the
        positional state joined the value stream, the attention output of its features (B, H, N, F) (else None); and
        the attention probabilities (B, H, N, T) when `output_attentions` (else None)."""
        batch, length = layout.batch, layout.length
        shape = (batch, length, -1, self.head_dim)
        q = layout.unpack(self.q_proj(hidden)).view(shape).transpose(1, 2)
        k = layout.unpack(self.k_proj(hidden)).view(shape).transpose(1, 2)
        v = layout.unpack(self.v_proj(hidden)).view(shape).transpose(1, 2)
        q, k = positional.transform_qk(q, k, state, ctx)
        extra = positional.value_extra(state)
        shared = None
        if extra is not None and cache is not None and same_for_every_head(extra):
            # cached once per token rather than once per KV head (TAPE's E0 in the first layer)
            shared = store_state(cache, self.layer_idx, SHARED_STREAM, extra[:, :1].to(v.dtype))
            stream = v
        else:
            stream = v if extra is None else torch.cat([v, extra.to(v.dtype)], dim=-1)
        q, k, stream, bias = positional.attention_inputs(
            layout.unpack(hidden), q, k, stream, self.head_dim, cache, self.layer_idx, mask.valid, ctx
        )
        bias = RowBias.add(ctx.bias, bias)
        q, bias = self._length_scaled(q, k, bias, positional, mask)
        scale, probs = positional.logit_scale(self.head_dim), None
        implementation = self.config._attn_implementation
        own = positional.attend(q, k, stream, shared, mask, scale, ctx, output_attentions)
        registered = implementation not in TAPELM_ATTENTION
        if own is None and not output_attentions and not registered:
            values, attended = attend_stream(
                q,
                k,
                stream,
                self.head_dim,
                mask,
                bias,
                scale,
                ctx.paths,
                eager=implementation == "eager",
                shared=shared,
            )
        else:
            if registered and own is not None:
                raise ValueError(
                    f"attn_implementation={implementation!r} computes softmax attention, but pe_type="
                    f"{self.config.pe_type!r} computes its own; use 'sdpa' or 'eager'"
                )
            if registered and output_attentions:
                raise ValueError(
                    f"output_attentions=True needs tapelm's own attention (attn_implementation 'sdpa' or "
                    f"'eager'); this model uses {implementation!r}"
                )
            if own is not None:
                out, probs = own
            elif output_attentions:
                out, probs = attend_with_probabilities(q, k, joined_stream(stream, shared), mask, bias, scale)
            else:
                function = ALL_ATTENTION_FUNCTIONS[implementation]
                out = attend_registered(function, self, q, k, joined_stream(stream, shared), mask, bias, scale)
            values, attended = out[..., : self.head_dim], (out[..., self.head_dim :] if extra is not None else None)
        out_v = layout.pack(values.transpose(1, 2).reshape(batch, length, -1))
        if self.output_gate is not None:
            out_v = self.output_gate(hidden, out_v)
        return self.o_proj(out_v), attended, probs

    def _length_scaled(self, q, k, bias, positional: LayerPositional, mask: AttentionMask):
        """q and the logit bias with each query's row times the factors of the keys it sees (SSMax's, the layer's
        `logit_length`), or as they are without either."""
        scalings = [module for module in (positional.logit_length, self.ssmax) if module is not None]
        if not scalings:
            return q, bias
        seen = mask.keys_seen(q.shape[-2], k.shape[-2], q.device)
        factor = scalings[0](seen)
        for module in scalings[1:]:
            factor = factor * module(seen)
        return (q * factor).to(q.dtype), scale_rows(bias, factor)


def same_for_every_head(extra: torch.Tensor) -> bool:
    """Whether a value-stream part (B, Hkv, N, F) is one head's expanded over the others (a zero stride), so that a
    cache can hold it once per token."""
    return extra.shape[1] > 1 and extra.stride(1) == 0


class RMSNorm(nn.Module):
    """transformers' Llama RMSNorm (the same parameter and epsilon), computed by `tapelm.kernels.norm` with the pass's
    fast paths. Not a subclass of `LlamaRMSNorm`: that class is a hub-kernel layer, whose forward transformers (from
    5.25, by default) replaces on a GPU with one that takes no fast paths."""

    def __init__(self, config: TapeConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(config.hidden_size))
        self.variance_epsilon = config.rms_norm_eps

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"

    def forward(self, hidden_states: torch.Tensor, paths: FastPaths) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, paths)


class MLP(LlamaMLP):
    """transformers' Llama SwiGLU MLP (the same parameters), its product silu(gate) * up computed by
    `tapelm.kernels.mlp` with the pass's fast paths (the config's activation is SiLU)."""

    def forward(self, x: torch.Tensor, paths: FastPaths) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), paths))


class TapeDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: attention then SwiGLU MLP, each followed by the positional state's update."""

    def __init__(self, config: TapeConfig, layer_idx: int, positional: LayerPositional):
        super().__init__()
        self.self_attn = TapeAttention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config)
        self.post_attention_layernorm = RMSNorm(config)
        self.positional = positional

    def forward(
        self,
        hidden,
        state,
        ctx: PositionContext,
        mask: AttentionMask,
        layout: TokenLayout,
        cache=None,
        output_attentions: bool = False,
    ):
        """`hidden` holds the tokens as `layout` lays them out (the real tokens only, when the batch is padded)."""
        attn_out, attended, probs = self.self_attn(
            self.input_layernorm(hidden, ctx.paths), self.positional, state, ctx, mask, cache, layout, output_attentions
        )
        hidden = hidden + attn_out
        state = self.positional.after_attention(state, attended, ctx)
        mlp_out = self.mlp(self.post_attention_layernorm(hidden, ctx.paths), ctx.paths)
        hidden = hidden + mlp_out
        return hidden, self.positional.after_mlp(state, layout.unpack(mlp_out), ctx), probs


class TapePreTrainedModel(PreTrainedModel):
    config_class = TapeConfig
    config: TapeConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["TapeDecoderLayer"]
    _skip_keys_device_placement = ["cache"]
    _supports_sdpa = True

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModel"):
        """Nothing to do (see `TapeConfig.register_for_auto_class`): a saved folder keeps its `tapelm.remote_code`
        modules, not a copy of modeling.py."""

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        """`set_attn_implementation` may switch at run time between "sdpa", "eager" and the functions registered with
        transformers' `AttentionInterface`: every attention call reads `config._attn_implementation` (transformers' own
        heuristic looks for its attention interface in the source and would refuse)."""
        return True

    def compile_layers(self, **options) -> None:
        """Compile each decoder layer with torch.compile (regional compilation: the layers share one compiled graph,
        so compiling takes seconds, not minutes); shapes are dynamic by default, so batches of other lengths reuse
        it. The model's own code around the layers (masks, padding, the loss) stays eager."""
        options.setdefault("dynamic", True)
        for module in self.modules():
            if isinstance(module, TapeDecoderLayer):
                module.compile(**options)

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, CustomInit):
            module.init_weights(init, self.config.initializer_range)


class TapeModel(TapePreTrainedModel):
    """Embeddings, decoder layers and final norm; returns hidden states and the cache.

    `skip_padding` (default True): in a padded batch the per-token work (norms, projections, MLP) runs on the real
    tokens only (`tapelm.layout`); False runs it on the whole padded grid, the same function at more cost (kept for
    the tests and the training benchmark)."""

    def __init__(self, config: TapeConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.positional = build_encoding(config)
        self.layers = nn.ModuleList(
            [TapeDecoderLayer(config, i, self.positional.make_layer(i)) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config)
        self.gradient_checkpointing = False
        self.skip_padding = True
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    @deprecate_kwarg("past_key_values", "6.0.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        paths: FastPaths | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """`paths`: the fast paths this pass runs, resolved by the caller (`TapeForCausalLM`) or here from the
        config's `fast_paths`. The keyword argument `host_layout` (a `tapelm.layout.HostLayout`, made with the batch)
        says where its padding and documents are, so that the pass reads none of it from the device."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids or inputs_embeds")
        check_cache_type(cache)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        cache = self._cache(cache, use_cache)
        past, fixed, key_length = self._cache_sizes(cache, inputs_embeds.shape[1])
        host = self._host_layout(kwargs.get("host_layout"), inputs_embeds, attention_mask, past, fixed)
        documents, position_ids = self._positions(inputs_embeds, position_ids, attention_mask, past, host, kwargs)
        # the mask first: it checks a given 4D mask before anything reads it or is stored in the cache
        mask = self._attention_mask(inputs_embeds, attention_mask, documents, past, key_length, fixed, host)
        if paths is None:
            paths = resolve(self.config.fast_paths, inputs_embeds.device, encodings_in(self.config))
        ctx = self._position_context(inputs_embeds, position_ids, attention_mask, documents, past, host, cache, paths)
        hidden, state, layout = self._layer_inputs(inputs_embeds, ctx, host)

        all_hidden = [] if output_hidden_states else None
        all_attentions = [] if output_attentions else None
        for index, layer in enumerate(self.layers):
            if all_hidden is not None:  # the layer reads the returned grid, so gradients reach it (as in Llama)
                all_hidden.append(layout.unpack(hidden))
                hidden = layout.pack(all_hidden[-1])
            hidden, state, probs = layer(
                hidden, state, ctx.for_layer(index), mask, layout, cache=cache, output_attentions=output_attentions
            )
            if all_attentions is not None:
                all_attentions.append(probs)
        hidden = layout.unpack(self.norm(hidden, paths))
        if all_hidden is not None:
            all_hidden.append(hidden)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden,
            cache=cache,
            hidden_states=tuple(all_hidden) if all_hidden is not None else None,
            attentions=tuple(all_attentions) if all_attentions is not None else None,
        )

    def _cache(self, cache: Cache | None, use_cache: bool | None) -> Cache | None:
        """The cache this pass writes, holding tapelm's cache layers: `cache`, or a new DynamicCache when
        `use_cache` (default: the config's) asks for one; None without caching."""
        use_cache = self.config.use_cache if use_cache is None else use_cache
        # As in transformers' Llama: activation checkpointing with gradients on turns caching off; without gradients
        # (generate) nothing is checkpointed, so the cache works.
        if use_cache and self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            logger.warning_once(
                "use_cache=True is incompatible with activation checkpointing in training mode; "
                "setting use_cache=False."
            )
            use_cache = False
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if not use_cache:
            cache = None
        prepare_cache(cache, self.positional.fixed_shape_cache)
        return cache

    @staticmethod
    def _cache_sizes(cache: Cache | None, length: int) -> tuple[int | torch.Tensor, bool, int]:
        """The number of tokens cached before this pass (`past`: a device tensor for a fixed-shape cache), whether
        the cache has fixed shapes (attention then sees the whole static cache, unwritten rows masked; ValueError when
        the pass's `length` new tokens do not fit) and the length of the keys attention sees."""
        past = cache.get_seq_length() if cache is not None else 0
        fixed = has_fixed_shapes(cache)
        key_length = capacity(cache) if fixed else past + length
        if fixed:
            check_room(cache, length)
        return past, fixed, key_length

    @staticmethod
    def _host_layout(host, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None, past, fixed: bool):
        """The batch's `host_layout`, checked against this pass; None while traced (traced programs read no data
        anyway)."""
        host = None if tracing(inputs_embeds) else host
        if host is not None:
            batch, length = inputs_embeds.shape[:2]
            host.check(batch, length, attention_mask, fixed or bool(past), inputs_embeds.device)
        return host

    def _positions(self, inputs_embeds, position_ids, attention_mask, past, host, kwargs: dict):
        """The document index of every new token when rows pack several documents (else None), and the tokens'
        position ids (`_position_ids`, or those `cu_seq_lens_q` implies when it comes without `position_ids`)."""
        batch, length = inputs_embeds.shape[:2]
        documents, document_positions = packed_documents(
            position_ids,
            attention_mask,
            past,
            self.config.causal,
            batch,
            length,
            kwargs.get("cu_seq_lens_q"),
            kwargs.get("cu_seq_lens_k"),
            host,
        )
        position_ids = self._position_ids(
            position_ids if document_positions is None else document_positions,
            attention_mask,
            past,
            batch,
            length,
            inputs_embeds.device,
        )
        return documents, position_ids

    def _attention_mask(self, inputs_embeds, attention_mask, documents, past, key_length, fixed, host) -> AttentionMask:
        """The mask of the new queries over `key_length` keys; dense where the encoding adds a logit bias or the
        cache has fixed shapes."""
        return build_attention_mask(
            attention_mask,
            documents,
            inputs_embeds.shape[1],
            key_length,
            self.config.causal,
            dense=self.positional.adds_logit_bias or fixed,
            device=inputs_embeds.device,
            past=past,
            padded=None if host is None else host.padded,
            segments=None if host is None or not self.config.causal else host.segments,
        )

    def _position_context(
        self, inputs_embeds, position_ids, attention_mask, documents, past, host, cache, paths
    ) -> PositionContext:
        """What every layer reads about positions: the queries' positions (and every key's, where the encoding
        asks), the real tokens, the fast paths, and what the encoding prepares from them."""
        ctx = PositionContext(
            query_positions=self.positional.positions(
                position_ids, past, documents, None if host is None else host.extent
            ),
            paths=paths,
            token_mask=real_tokens(attention_mask, inputs_embeds.shape[1], past, None if host is None else host.padded),
            distinct_rows=None if host is None else host.distinct,
        )
        if self.positional.needs_key_positions:
            ctx.key_positions = key_positions(cache, ctx.query_positions)
        self.positional.prepare(ctx, inputs_embeds.dtype)
        return ctx

    def _layer_inputs(self, inputs_embeds, ctx: PositionContext, host):
        """The first layer's hidden states (the embeddings as the encoding enters them, packed to the real tokens
        when `skip_padding`), the encoding's initial state, and the token layout the layers run on."""
        hidden = self.positional.embed(inputs_embeds, ctx)
        state = self.positional.initial_state(ctx, hidden.dtype)
        batch, length = inputs_embeds.shape[:2]
        index = None if host is None else host.index
        layout = TokenLayout.of(ctx.token_mask if self.skip_padding else None, batch, length, index)
        return layout.pack(hidden), state, layout

    @staticmethod
    def _position_ids(position_ids, attention_mask, past, batch, length, device):
        """Given positions, or positions counted over real tokens (a 2D mask with left padding), or past + 0..N-1
        (also with a 4D mask, as Llama: pass position_ids for its padded rows)."""
        if position_ids is not None:
            return position_ids.expand(batch, -1) if position_ids.shape[0] == 1 else position_ids
        if attention_mask is not None and attention_mask.dim() == 2:
            return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -length:]
        return (torch.arange(length, device=device) + past).expand(batch, -1)


class TapeForCausalLM(TapePreTrainedModel, GenerationMixin):
    """`TapeModel` with a language-modelling head; `generate` works with a cache."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: TapeConfig):
        super().__init__(config)
        self.model = TapeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def prepare_inputs_for_generation(self, *args, cache: Cache | None = None, **kwargs):
        """transformers' own, after `generate`'s new cache got tapelm's layers (a static one would otherwise be given a
        4D mask of its whole length, made for transformers' static layers)."""
        prepare_cache(cache, self.model.positional.fixed_shape_cache)
        return super().prepare_inputs_for_generation(*args, cache=cache, **kwargs)

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        """transformers' own, judged on tapelm's layers: a static cache compiles the decode step unless the encoding
        reads its cache as a sequence (PaTH)."""
        prepare_cache(model_kwargs.get("cache"), self.model.positional.fixed_shape_cache)
        return super()._valid_auto_compile_criteria(model_kwargs, generation_config)

    def tape_parameters(self) -> Iterator[nn.Parameter]:
        """Exactly the parameters TAPE adds to a RoPE transformer (selected by module type)."""
        for module in self.modules():
            if isinstance(module, TapeLayer):
                yield from module.parameters()

    @deprecate_kwarg("past_key_values", "6.0.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        given = input_ids if input_ids is not None else inputs_embeds  # neither: the model's own error follows
        paths = None if given is None else resolve(self.config.fast_paths, given.device, encodings_in(self.config))
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            return_dict=True,
            paths=paths,
            **kwargs,
        )
        hidden = outputs.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            hidden = hidden[:, logits_to_keep]
        if labels is not None and self.training:  # training with labels: the loss without the logits, where it can
            loss = loss_without_logits(hidden, self.lm_head.weight, labels, paths, **kwargs)
            if loss is not None:
                return CausalLMOutputWithPast(
                    loss=loss, cache=outputs.cache, hidden_states=outputs.hidden_states, attentions=outputs.attentions
                )
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
