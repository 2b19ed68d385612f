"""`TapeConfig`: Llama-style model sizes, the positional encoding switch and TAPE's options."""

from __future__ import annotations

from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

from .attention_options import check_attention_options
from .fast_paths import check_setting as check_fast_paths
from .positional import (
    BUILT_IN,
    add_encoding_fields,
    encoding_class,
    encodings_in,
    layer_encodings,
    validate_encodings,
)
from .positional.base import check_choice, check_positive
from .remote_code import AUTO_MAP, write_modules

PE_TYPES = tuple(BUILT_IN)
"""tapelm's own encodings; `tapelm.encoding_names()` also lists those registered from outside."""
ROTARY_PE_TYPES = ("tape", "rope", "randpe", "xpos")


class TapeConfig(PreTrainedConfig):
    r"""Configuration of a `TapeModel` / `TapeForCausalLM`.

    The sizes follow `LlamaConfig`. `pe_type` selects the positional encoding; every encoding shares one decoder
    skeleton. TAPE's options (see shared/TAPE.md):

    - `tape_block` (L, R): each head's q/k vector is split into M = head_dim / L blocks of size L; a positional
      feature is an L x R matrix per block. (2, 2) is RoPE's shape.
    - `tape_position_size`: width I of the content gate of the MLP-branch update (default 4 x heads).
    - `tape_attn_mixing`: "heads" mixes the attended positional features across heads (H x H map), "per_head"
      applies one gain per head.
    - `tape_update`: which sublayers update the positional features ("none" freezes them at RoPE's).
    - `tape_equivariant`: False is the ablation that also mixes across blocks and the l/r axes.
    - `tape_layers`: which layers update the positional features: "all" (default), "none", "first_half",
      "second_half", or a list of layer indices. The others pass E on unchanged (still rotating q and k by it); the
      last layer never updates (its E would be discarded).
    - `causal`: False gives a bidirectional encoder.

    - `rope_fraction` p (pe_type "rope" only): p-RoPE (Barbero et al., ICLR 2025): only the floor(p x head_dim / 2)
      highest of RoPE's frequencies rotate, the lowest pairs of dimensions are left as they are (transformers'
      `rope_type="proportional"` with `partial_rotary_factor` p computes the same rotation); 1 (default) is RoPE,
      0 leaves every pair unrotated (NoPE).
    - `rope_layers` (pe_type "rope" only): which layers rotate q and k, the others attending without a positional
      encoding (NoPE): "all" (default), "nope-every-4th" (every fourth layer NoPE, the 4th, 8th, ...: SmolLM3's
      `no_rope_layer_interval` 4, as Llama 4 places its NoPE layers; Llama 4 also sets `nope_temperature_tuning`),
      or a list of the layer indices that rotate.
      Kept for saved configs: it is the RoPE/NoPE case of `layer_pe_types`, and computes what that schedule does.

    `layer_pe_types` gives each layer its own encoding (`tapelm.positional.schedule`): None (default: every layer
    uses `pe_type`), a list of one registered pe_type per layer, or a preset applied to `pe_type`: "nope-every-4th"
    (the 4th, 8th, ... layers NoPE: SmolLM3, Llama 4) or "nope-every-2nd" (NoPE and `pe_type` layers interleaved
    one to one, as RNoPE, without its sliding window). Each layer computes what the model of its encoding computes
    there; a mix may not hold encodings that change the input embeddings or the positions of every layer (learned,
    sinusoidal, randpe).

    Baselines follow the paper's official code (VITA-Group/TAPE, models/llama/*.py) unless said otherwise:

    - `xpos_scale_base` 2048 (models/llama/xpos.py, `XposRotaryEmbedding(scale_base=2048)`).
    - `t5_shared` False: one bias table per layer (models/llama/t5rb.py builds `relative_attention_bias` inside each
      attention layer); True shares one table across layers (T5's own choice, and tapelm's earlier default).
    - `fire_shared` False: one FIRE module per layer (models/llama/fire.py builds `FIRE(num_heads)` inside each
      attention layer), with `fire_init_c` 0.1 and `fire_init_threshold` L = 512 (`FIRE(init_c=0.1, init_L=512.0)`);
      True shares one module across layers.
    - `randpe_eval_positions` "random": RandPE draws a fresh sorted subset of [0, `randpe_max_position`) in every
      forward pass, at evaluation as in training, as both Ruoss et al.'s code (google-deepmind/
      randomized_positional_encodings, models/transformer.py applies the noisy rotary encoding unconditionally and
      experiments/range_evaluation.py evaluates with a random key) and the official code (models/llama/randrope.py) do.
      "given" evaluates on the given positions 0, 1, 2, ... (cached decoding needs it). One draw per forward pass is
      shared by all layers (Ruoss et al.'s description); both codes draw per layer.

    Contextual peers (`pe_type` "fox", "path" and "wall", causal only, no RoPE):

    - FoX (Lin et al. 2025): `fox_gate_bias_init` is the forget gate's bias at initialisation (0, as the reference
      zhixuan-lin/forgetting-transformer initialises its data-dependent gate).
    - PaTH (Yang et al. 2025): `path_low_rank` is the rank of the projection producing the Householder vectors
      (32 as fla's `use_low_rank_w`; 0 means a full-rank projection) and `path_conv_size` the kernel of their short
      causal convolution (3 as fla's `conv_size`; 1 means no history).
    - Wall (Tilde Research 2026, fla's `WallAttention`; `pe_type` "wall"): `wall_gate_bias_init` is the bias of the
      per-channel decay gates at initialisation (8 as fla's `gate_init_bias`: every gate starts near 1, attention
      near plain softmax); `wall_scalar_gate` False (fla's `use_scalar_gate`) adds FoX's gate per head, its bias
      starting at `wall_gate_bias_init` too.

    GRAPE (Zhang et al. 2025; `pe_type` "grape-m-fixed", "grape-m", "grape-ap", "grape-a-q", "grape-a-k" and
    "grape-a-qk"), with the defaults of the authors' code and configurations (model-architectures/GRAPE;
    docs/ENCODINGS.md says where they differ from the paper):

    - multiplicative ("grape-m-fixed", "grape-m"): `grape_learnable_freq` True (the per-plane frequencies, one set per
      layer, start at RoPE's spectrum from `rope_parameters`), `grape_share_across_heads` True (False: one set per KV
      head); "grape-m-fixed" stores them as s log(theta) with s = `grape_log_freq_scale` 16.
    - "grape-m": the per-token increment omega = sigmoid((w . x + b) / `grape_ctx_omega_scale`) with w = 0 and
      b = log(expm1(`grape_ctx_init_omega`)) at initialisation (16 and 1e-3), one per token (`grape_ctx_per_head`
      False) or per KV head.
    - "grape-ap": `grape_ap_tie` "none" (a positional projection of width `grape_ap_head_dim` 8 per head, as the
      authors' runs; "q", "k", "v" use that projection's output instead, of width head_dim), rotated at
      `grape_ap_base` 1 (every plane at one radian per position).
    - gated additive ("grape-a-q", "grape-a-k", "grape-a-qk"): each head's rate omega = ALiBi's slope x
      softplus(w), w starting at softplus^-1(`grape_a_omega_init`) 1 (omega = the slope); the gate directions are
      L2-normalised (`grape_a_gate_l2_norm` True).

    PoPE (Gopalakrishnan et al. 2025; `pe_type` "pope"), as lucidrains/x-transformers' `polar_pos_emb`: magnitudes
    softplus(q), softplus(k), phases position x RoPE's spectrum for a head twice as wide (theta from
    `rope_parameters`), and a learned phase offset per head and frequency, clamped to [-2 pi, 0], starting at 0
    (`pope_bias_init` "zero") or uniform in [-2 pi, 0] ("uniform", x-transformers' `polar_bias_uniform_init`);
    each layer its own offsets (`pope_shared_bias` False), or one set every layer shares (True: x-transformers' one
    `PolarEmbedding` for all layers).
    Stick-breaking attention (Tan et al. 2025; `pe_type` "stickbreaking", causal only, no position signal beyond the
    order the stick breaks in): a query does not see its own key (`stickbreaking_attend_current` False, as fla's and
    the authors' defaults).

    Selective RoPE (Movahedi, Carstensen et al. 2026; `pe_type` "selective-rope"): q and k rotated by RoPE's
    frequencies (theta `selective_rope_theta`, times `selective_rope_temperature`) times a running sum of phases the
    content chooses: the normed attention input, L2-normalised per head chunk, through a rank-`selective_rope_rank`
    projection and a causal convolution of `selective_rope_conv_size` (`selective_rope_conv_activation` after it),
    plus exp of a learned bias (`selective_rope_bias`), times a sigmoid gate (`selective_rope_gate`: None,
    "standard", "low-rank" or "gla", of rank `selective_rope_gate_rank`); the authors' code's defaults
    (`tapelm.positional.selective_rope`).

    NoPE layers (`pe_type` "nope", or a schedule's) with `nope_temperature_tuning` scale each query's logits as
    Llama 4's NoPE layers do (transformers' Llama4 `attn_temperature_tuning`): by 1 + `nope_attn_scale` x
    log1p(floor(n / `nope_floor_scale`)), n the keys the query sees (Llama 4's 0.1 and 8192 by default).

    Options of the attention, whatever the encoding (`tapelm.attention_options`): `ssmax` (SSMax: each softmax row
    over n keys scales its logits by s log n, s learned per head and layer from `ssmax_scale_init`; not with an
    encoding that computes its attention itself) and `attention_gate` (None, "elementwise" or "headwise": the heads'
    outputs times sigmoid of a projection of the attention input, as Qwen3-Next's gated attention).

    `attention_bias` puts biases on q, k, v and o (Llama's meaning); `qkv_bias` on q, k and v only (Qwen2's).

    `fast_paths`: "auto" (default) runs each fast path (a kernel or formulation computing the same function as its
    plain PyTorch reference, `tapelm.fast_paths`) on the devices where the law tests have passed with it on; "on" runs
    every fast path the device offers, verified or not; "off" runs the reference paths only; a list of path names
    (`tapelm.fast_paths.NAMES`, e.g. ["rotation-triton", "attention-unpadded"]) runs exactly those.
    """

    model_type = "tape"
    keys_to_ignore_at_inference = ["cache"]

    vocab_size: int = 256
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    pe_type: str = "tape"
    tape_block: tuple[int, int] | list[int] = (2, 2)
    tape_position_size: int | None = None
    tape_attn_mixing: str = "heads"
    tape_update: str = "both"
    tape_equivariant: bool = True
    tape_layers: str | list[int] = "all"
    causal: bool = True
    rope_fraction: float = 1.0
    rope_layers: str | list[int] = "all"
    layer_pe_types: str | list[str] | None = None
    randpe_max_position: int | None = None
    randpe_eval_positions: str = "random"
    xpos_scale_base: float = 2048.0
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
    t5_shared: bool = False
    fire_hidden_size: int = 32
    fire_shared: bool = False
    fire_init_c: float = 0.1
    fire_init_threshold: float = 512.0
    cope_max_positions: int = 64
    fox_gate_bias_init: float = 0.0
    path_low_rank: int = 32
    path_conv_size: int = 3
    wall_gate_bias_init: float = 8.0
    wall_scalar_gate: bool = False
    grape_learnable_freq: bool = True
    grape_share_across_heads: bool = True
    grape_log_freq_scale: float = 16.0
    grape_ctx_per_head: bool = False
    grape_ctx_init_omega: float = 1e-3
    grape_ctx_omega_scale: float = 16.0
    grape_ap_tie: str = "none"
    grape_ap_head_dim: int = 8
    grape_ap_base: float = 1.0
    grape_a_omega_init: float = 1.0
    grape_a_gate_l2_norm: bool = True
    pope_bias_init: str = "zero"
    pope_shared_bias: bool = False
    stickbreaking_attend_current: bool = False
    selective_rope_rank: int = 32
    selective_rope_conv_size: int = 4
    selective_rope_conv_activation: str | None = None
    selective_rope_theta: float = 500000.0
    selective_rope_temperature: float = 1.0
    selective_rope_bias: bool = False
    selective_rope_gate: str | None = None
    selective_rope_gate_rank: int = 16
    nope_temperature_tuning: bool = False
    nope_floor_scale: float = 8192.0
    nope_attn_scale: float = 0.1
    ssmax: bool = False
    ssmax_scale_init: float = 0.43
    attention_gate: str | None = None
    fast_paths: str | list[str] = "auto"
    encoding_packages: dict[str, str] | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and isinstance(self.num_attention_heads, int) and self.num_attention_heads > 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.tape_position_size is None and isinstance(self.num_attention_heads, int):
            self.tape_position_size = 4 * self.num_attention_heads
        if self.randpe_max_position is None and isinstance(self.max_position_embeddings, int):
            self.randpe_max_position = 2 * self.max_position_embeddings
        self.tape_block = tuple(self.tape_block)
        for name in ("fast_paths", "layer_pe_types"):  # a list, as config.json reads it back
            if isinstance(getattr(self, name), tuple):
                setattr(self, name, list(getattr(self, name)))
        super().__post_init__(**kwargs)
        # the `tapelm.remote_code` modules every saved folder gets: part of the config itself, so that a config read
        # back from its JSON equals the one written
        self.auto_map = dict(AUTO_MAP)
        add_encoding_fields(self)
        self._validate()

    def tape_updates_layer(self, layer_idx: int) -> bool:
        """Whether TAPE layer `layer_idx` updates the positional features (`tape_layers`; never the last TAPE layer of
        the schedule, `layer_pe_types`)."""
        layers = self.num_hidden_layers
        if layer_idx >= max((i for i, name in enumerate(layer_encodings(self)) if name == "tape"), default=-1):
            return False
        chosen = {
            "all": range(layers),
            "none": (),
            "first_half": range(layers // 2),
            "second_half": range(layers // 2, layers),
        }
        return layer_idx in (chosen[self.tape_layers] if isinstance(self.tape_layers, str) else self.tape_layers)

    @property
    def tape_l(self) -> int:
        return self.tape_block[0]

    @property
    def tape_r(self) -> int:
        return self.tape_block[1]

    def _validate(self) -> None:
        """Raise ValueError naming the first invalid field or combination: the model's fields here, then each
        encoding's own, checked by its module (`tapelm.positional.validate_encodings`)."""
        check_fast_paths(self.fast_paths)
        check_choice("hidden_act", self.hidden_act, ("silu",))
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            check_positive(field, getattr(self, field))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be divisible by "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not isinstance(self.rms_norm_eps, (int, float)) or self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps!r} is not allowed; it must be a positive number")
        validate_encodings(self)
        check_attention_options(self, {name: encoding_class(name) for name in encodings_in(self)})

    def to_dict(self):
        output = super().to_dict()
        output["tape_block"] = list(self.tape_block)
        return output

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        """config.json, and the modules its `auto_map` names (`tapelm.remote_code`)."""
        super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        write_modules(save_directory)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        """Nothing to do: loading a saved folder with trust_remote_code calls this, which would make the next
        save_pretrained copy config.py into the folder instead of its `tapelm.remote_code` module."""


__all__ = ["TapeConfig", "PE_TYPES"]
