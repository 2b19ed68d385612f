"""Pretrained Llama-family checkpoints -> `TapeForCausalLM`, exact at step 0 (shared/TAPE.md §6).

`from_pretrained_llama` reads the sizes, RoPE (with its scaling), GQA, tied embeddings and biases of a transformers
`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM` or `SmolLM3ForCausalLM`, builds the matching `TapeConfig`
(TAPE by default; `pe_type="rope"` gives the same model in tapelm's skeleton, which is what the fine-tuning baselines
use), copies every weight, and leaves TAPE's own parameters at their initialisation (W_att = W_up = 0), so the
converted model computes the source's logits. SmolLM3's NoPE layers (`no_rope_layers`) become NoPE layers of a
per-layer schedule (`layer_pe_types`), the others `pe_type`'s.

Sliding-window attention (Mistral, Qwen2 with `use_sliding_window`) is not part of tapelm's skeleton: such a model
is converted with full causal attention and a warning naming `sliding_window`. The two agree exactly on sequences up
to `sliding_window` tokens and differ beyond.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from .config import TapeConfig
from .modeling import TapeForCausalLM
from .positional import layer_encodings
from .positional.rotary import TapeRotaryEmbedding

logger = logging.getLogger(__name__)

# model_type -> the transformers causal-LM class it must be (every one: rotate-half RoPE, SwiGLU MLP, RMSNorm).
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
}
CONVERTIBLE_PE_TYPES = ("tape", "rope", "grape-m-fixed")
# Options a caller may not override: they are read from the source checkpoint.
_COPIED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_bias",
    "qkv_bias",
    "mlp_bias",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "causal",
    "layer_pe_types",
)


def _supported() -> str:
    return ", ".join(f"{cls} ({kind})" for kind, cls in SUPPORTED_ARCHITECTURES.items())


def check_source(config: PretrainedConfig) -> None:
    """Raise ValueError unless `config` is a RoPE model of a family tapelm converts exactly."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"cannot convert a {model_type!r} model ({', '.join(config.architectures or [])}); "
            f"supported: {_supported()}"
        )
    rope = getattr(config, "rope_parameters", None)
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        raise ValueError(
            f"cannot convert a {model_type!r} model without RoPE (rope_parameters={rope!r}); "
            f"supported: RoPE models of {_supported()}"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0 and rope.get("rope_type") != "proportional":
        raise ValueError(
            f"cannot convert partial rotary embeddings (partial_rotary_factor="
            f"{rope['partial_rotary_factor']}); tapelm rotates the whole head dimension"
        )
    if config.hidden_act != "silu":
        raise ValueError(f"cannot convert hidden_act={config.hidden_act!r}; tapelm's MLP is SwiGLU (silu)")


def _attention_biases(config: PretrainedConfig) -> dict:
    """The TapeConfig bias fields for the source's attention projections."""
    if config.model_type == "qwen2":  # q, k, v biased, o not
        return {"attention_bias": False, "qkv_bias": True}
    return {"attention_bias": bool(getattr(config, "attention_bias", False))}


def _layer_schedule(config: PretrainedConfig, pe_type: str) -> dict:
    """SmolLM3's NoPE layers (`no_rope_layers[i]` 0) as `layer_pe_types`: `pe_type` where the source rotates."""
    rotates = getattr(config, "no_rope_layers", None)
    if rotates is None or all(rotates):
        return {}
    return {"layer_pe_types": [pe_type if rotate else "nope" for rotate in rotates]}


def _sliding_window(config: PretrainedConfig) -> int | None:
    """The window of the source's sliding-window layers, or None when every layer attends fully."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None:
        return None
    if config.model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        return None
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def tape_config_from(
    config: PretrainedConfig, pe_type: str = "tape", rope_overrides: dict | None = None, **options
) -> TapeConfig:
    """The `TapeConfig` of a Llama-family config: copied sizes/RoPE/ids, plus `pe_type`, TAPE options and changes to
    `rope_parameters` (`rope_overrides`, merged into the copied ones)."""
    check_source(config)
    if pe_type not in CONVERTIBLE_PE_TYPES:
        raise ValueError(
            f"pe_type={pe_type!r} cannot be converted exactly; choose one of: {', '.join(CONVERTIBLE_PE_TYPES)}"
        )
    clash = sorted(set(options) & set(_COPIED_FIELDS))
    if clash:
        raise ValueError(
            f"{', '.join(clash)} come from the source checkpoint and cannot be overridden; "
            "pass TAPE options (tape_*) or rope_parameters via `rope_overrides` instead"
        )
    window = _sliding_window(config)
    if window is not None and window < config.max_position_embeddings:
        logger.warning(
            "tapelm: the source uses sliding_window=%d; the converted model attends to the full causal "
            "context, so it matches the source exactly only on sequences of at most %d tokens",
            window,
            window,
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    fields = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=bool(config.tie_word_embeddings),
        rope_parameters={**config.rope_parameters, **(rope_overrides or {})},
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        initializer_range=getattr(config, "initializer_range", 0.02),
        **_attention_biases(config),
        **_layer_schedule(config, pe_type),
    )
    return TapeConfig(**fields, pe_type=pe_type, **options)


def from_pretrained_llama(
    model_or_path: PreTrainedModel | str | Path,
    pe_type: str = "tape",
    dtype: torch.dtype | None = None,
    rope_overrides: dict | None = None,
    **tape_options,
) -> TapeForCausalLM:
    """Convert a Llama-family causal LM (a model object, or a checkpoint folder or hub name that transformers'
    `AutoModelForCausalLM` loads) to a `TapeForCausalLM` with every weight copied. tapelm's named sources (such as
    ``"smollm2-135m"``) and ``.gguf`` files load with the lab's `tapelm.pretrained.sources.load_pretrained`.

    `pe_type`: "tape" (default), "rope" (the same network in tapelm's skeleton) or "grape-m-fixed" (RoPE's
    frequencies made learnable, the same network at step 0; default RoPE only, no scaling). `tape_options` are
    TapeConfig's TAPE fields (`tape_block`, `tape_position_size`, `tape_attn_mixing`, `tape_update`, ...).
    `rope_overrides` are merged into the copied `rope_parameters` (e.g. ``{"rope_theta": 1e6}`` or a linear
    scaling); without them the result's logits equal the source's. The result is in eval mode, on the source's
    device, in `dtype` (default: the source's)."""
    source = _load_source(model_or_path)
    config = tape_config_from(source.config, pe_type=pe_type, rope_overrides=rope_overrides, **tape_options)
    weight = next(source.parameters())
    with torch.device(weight.device):
        model = TapeForCausalLM(config)
    copy_weights(source, model)
    if rope_overrides and config.rope_parameters != source.config.rope_parameters:
        check_rotation_changed(source, model)
    model.generation_config = source.generation_config
    return model.to(dtype or weight.dtype).eval()


def rotation_tables(model: torch.nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (N, head_dim / 2) of the rotation a Llama-family or tapelm model applies at `positions` (N,), in
    float32, with its scaling's attention factor: what its rotary embedding module computes for them in a forward
    pass (so dynamic scalings see the positions too)."""
    rotary = next(m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding"))
    anchor = torch.empty(0, dtype=torch.float32, device=positions.device)
    cos, sin = rotary(anchor, positions[None])
    half = cos.shape[-1] if isinstance(rotary, TapeRotaryEmbedding) else cos.shape[-1] // 2
    return cos[0, :, :half].float(), sin[0, :, :half].float()


def check_rotation_changed(source: torch.nn.Module, model: TapeForCausalLM) -> None:
    """ValueError unless the rotation `model` applies differs from the source's somewhere within four times the
    source's window: a change of `rope_parameters` that the model did not take would leave a context extension
    silently undone (as setting a scaling on a model whose frequencies were computed at its construction does)."""
    window = int(source.config.rope_parameters.get("original_max_position_embeddings") or 0)
    window = window or source.config.max_position_embeddings
    positions = torch.arange(4 * window, device=next(source.parameters()).device)
    with torch.no_grad():
        before, after = rotation_tables(source, positions), rotation_tables(model, positions)
    if all(torch.equal(old, new) for old, new in zip(before, after)):
        raise ValueError(
            f"rope_parameters {model.config.rope_parameters} leave the rotation unchanged at positions 0 to "
            f"{4 * window - 1} (the source's: {source.config.rope_parameters}); a scaling that changes nothing "
            "extends nothing"
        )


def copy_weights(source: torch.nn.Module, target: TapeForCausalLM) -> None:
    """Load every source weight into `target`; only the encoding's own parameters (TAPE's, GRAPE-M's frequency
    shifts) may be left out. Raises ValueError naming any other mismatch."""
    missing, unexpected = target.load_state_dict(source.state_dict(), strict=False)
    own = {name for name, _ in target.named_parameters() if ".positional." in f".{name}"}
    unexplained = sorted(set(missing) - own)
    if unexpected or unexplained:
        raise ValueError(
            f"weights do not match: source weights with no place in the tapelm model: {unexpected}; "
            f"tapelm-model weights the source lacks: {unexplained}"
        )


def _load_source(model_or_path) -> PreTrainedModel:
    """The source model: itself, or what transformers' `AutoModelForCausalLM` loads from a folder or hub name."""
    if isinstance(model_or_path, PreTrainedModel):
        check_source(model_or_path.config)
        return model_or_path
    from transformers import AutoConfig, AutoModelForCausalLM

    check_source(AutoConfig.from_pretrained(str(model_or_path)))
    return AutoModelForCausalLM.from_pretrained(str(model_or_path), use_kernels=False)


def save(model: TapeForCausalLM, tokenizer: PreTrainedTokenizerBase | None, dst: str | Path) -> Path:
    """Save a converted model (and its tokenizer) to `dst` for the Auto classes; returns `dst`."""
    dst = Path(dst)
    model.save_pretrained(dst)
    if tokenizer is not None:
        tokenizer.save_pretrained(dst)
    return dst


def to_llama(model: TapeForCausalLM, max_position_embeddings: int | None = None):
    """The `LlamaForCausalLM` computing exactly what a RoPE `TapeForCausalLM` computes (every weight copied), e.g. to
    hand a base model tapelm trained to any Llama-family tool; `max_position_embeddings` overrides the window its
    config states (the length it was trained at). On the model's device, in its dtype; ValueError for a model that is
    not plain RoPE."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = model.config
    if config.pe_type != "rope" or getattr(config, "qkv_bias", False) or not getattr(config, "causal", True):
        raise ValueError(
            f"only a causal RoPE model without q/k/v-only biases converts to Llama (this one: pe_type="
            f"{config.pe_type!r}); convert the other way with from_pretrained_llama"
        )
    if config.rope_fraction != 1:
        raise ValueError(
            f"a p-RoPE model (rope_fraction={config.rope_fraction}) leaves some frequencies unrotated, which Llama "
            "cannot: only rope_fraction=1 converts to Llama"
        )
    if set(layer_encodings(config)) != {"rope"}:
        raise ValueError(
            f"a model with other layers than RoPE's (layer_pe_types={config.layer_pe_types!r}, rope_layers="
            f"{config.rope_layers!r}) does not convert to Llama, which rotates in every layer: only a model whose "
            "every layer is RoPE converts"
        )
    fields = {
        name: getattr(config, name)
        for name in _COPIED_FIELDS
        if name not in ("qkv_bias", "causal", "max_position_embeddings")
    }
    llama_config = LlamaConfig(
        **fields,
        max_position_embeddings=max_position_embeddings or config.max_position_embeddings,
        initializer_range=config.initializer_range,
    )
    weight = next(model.parameters())
    with torch.device(weight.device):
        llama = LlamaForCausalLM(llama_config).to(weight.dtype)
    llama.load_state_dict(model.state_dict(), strict=True)
    llama.generation_config = model.generation_config
    return llama.eval()
