"""Parameter-efficient fine-tuning of a converted pretrained model: TAPE against LoRA, LongLoRA, theta scaling and
position interpolation (shared/TAPE.md §6), every method in tapelm's one decoder skeleton with the same budget.

Methods (trainable sets are chosen by module type, never by parameter-name substrings):

- ``tape``: converted to TAPE (exact at step 0); trains TAPE's own parameters (`TapeForCausalLM.tape_parameters()`,
  the `TapeLayer` modules) plus, by default, LoRA and the embeddings and norms, so that it differs from ``lora`` only
  by TAPE (`--no-lora`, `--no-embeddings`, `--no-norms` switch these off).
- ``lora``: RoPE; peft LoRA (rank 8, alpha 16) on q/k/v/o plus the embeddings and norms.
- ``longlora``: ``lora`` plus shifted sparse attention (S²-Attn, `tapelm.longlora`) while training; full attention
  when evaluating. With `interpolate_positions` also linear position interpolation by target_length /
  pretrained_length, as LongLoRA extends a context (its groups of a quarter of the target length would otherwise
  never show the model a distance beyond its window).
- ``theta``: ``lora`` with the RoPE base raised to `theta` (default 1e6).
- ``pi``: ``lora`` with linear position interpolation by target_length / pretrained_length.
- ``yarn``: ``lora`` with YaRN (transformers' ``rope_type="yarn"``) by the same factor.
- ``full``: RoPE, every weight trained (no LoRA): the upper bound of a fine-tune with the same budget.

LoRA is merged into the weights after training, so the saved model is a plain `TapeForCausalLM` that
`AutoModelForCausalLM.from_pretrained` loads (after ``import tapelm``).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..conversion import from_pretrained_llama
from ..modeling import RMSNorm, TapeAttention, TapeForCausalLM
from ..positional import TapeLayer

logger = logging.getLogger(__name__)

METHODS = ("tape", "lora", "longlora", "theta", "pi", "yarn", "full")
SCALED_METHODS = ("pi", "yarn")  # position scalings by target_length / pretrained_length
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class FinetuneSettings:
    """One method's recipe. The budget fields (train_length, steps, batch_size, grad_accum, lr, warmup) must be the
    same for every method compared."""

    method: str
    train_length: int = 128
    steps: int = 150
    batch_size: int = 1
    grad_accum: int = 1
    lr: float = 2e-4
    warmup: int = 10
    seed: int = 0
    lora: bool = True
    lora_rank: int = 8
    lora_alpha: int = 16
    train_embeddings: bool = True
    train_norms: bool = True
    theta: float = 1e6
    target_length: int | None = None
    pretrained_length: int | None = None
    s2_group_fraction: float = 0.25
    interpolate_positions: bool = False  # longlora: with linear position interpolation (LongLoRA's extension)
    train_tokens: int = 400_000
    checkpoint_every: int = 30
    eval_every: int = 0  # steps between evaluations while training (0: none)
    prose_corpus: str | None = None  # None: python3.11-doc (see tapelm.pretrained.data)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is not allowed; choose one of: {', '.join(METHODS)}")
        if self.method == "full" and self.lora:
            raise ValueError("method 'full' trains every weight; lora must be False")
        if self.method not in ("tape", "full") and not self.lora:
            raise ValueError(f"method={self.method!r} always trains LoRA; lora=False is only for method 'tape'")
        for name in ("train_length", "steps", "batch_size", "grad_accum", "lora_rank", "lora_alpha", "train_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed; it must be a positive integer")
        for name in ("warmup", "seed", "checkpoint_every", "eval_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r} is not allowed; it must be a non-negative integer")
        for name in ("lr", "theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
                raise ValueError(f"{name}={value!r} is not allowed; it must be a positive number")
        for name in ("target_length", "pretrained_length"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}={value!r} is not allowed; it must be a positive integer")
        if self.interpolate_positions and self.method != "longlora":
            raise ValueError(f"interpolate_positions is for method 'longlora' (method {self.method!r}: use 'pi')")
        if self.method in SCALED_METHODS and self.pretrained_length is not None:
            scale_factor(self, self.pretrained_length)  # the identity is refused now, not after loading the model
        group = self.s2_group()
        if self.method == "longlora" and (group < 2 or group % 2 or self.train_length % group):
            raise ValueError(
                f"s2_group_fraction={self.s2_group_fraction} of train_length={self.train_length} must "
                "give an even group size that divides train_length"
            )
        self.train_settings()  # the training loop's own checks, now

    def train_settings(self):
        """The `tapelm.training.settings.TrainSettings` of this recipe."""
        from ..training.settings import TrainSettings

        return TrainSettings(
            steps=self.steps,
            lr=self.lr,
            warmup=self.warmup,
            schedule="constant",
            weight_decay=0.0,
            batch_size=self.batch_size,
            grad_accum=self.grad_accum,
            clip=1.0,
            checkpoint_every=self.checkpoint_every,
            eval_every=self.eval_every,
            keep_last=1,
            log_every=5,
            seed=self.seed,
        )

    def s2_group(self) -> int:
        return int(self.train_length * self.s2_group_fraction)

    def to_dict(self) -> dict:
        return asdict(self)


def scale_factor(settings: FinetuneSettings, pretrained_length: int) -> float:
    """target_length / pretrained_length of a position scaling (pi, yarn); ValueError when that is not > 1 (the
    scaling would change nothing)."""
    pretrained = settings.pretrained_length or pretrained_length
    if settings.target_length is None:
        raise ValueError(f"method {settings.method!r} needs target_length (the context to reach by scaling)")
    factor = settings.target_length / pretrained
    if factor <= 1:
        raise ValueError(
            f"target_length={settings.target_length} does not exceed the pretrained context "
            f"{pretrained}: linear interpolation would be the identity; raise target_length "
            "(--target-length) or lower pretrained_length (--pretrained-length)"
        )
    return factor


def build_model(source, settings: FinetuneSettings) -> TapeForCausalLM:
    """The method's starting model: `source` (a Llama-family model, path or source name) converted to tapelm."""
    if settings.method == "tape":
        return from_pretrained_llama(source, pe_type="tape")
    overrides = None
    if settings.method == "theta":
        overrides = {"rope_theta": float(settings.theta)}
    elif settings.method in SCALED_METHODS or settings.interpolate_positions:
        if isinstance(source, (str, Path)):
            from .sources import load_pretrained

            source = load_pretrained(str(source))[0]
        scaling = "pi" if settings.interpolate_positions else settings.method
        overrides = scaling_overrides(
            scaling, settings.target_length, settings.pretrained_length or pretrained_window(source.config)
        )
    return from_pretrained_llama(source, pe_type="rope", rope_overrides=overrides)


def pretrained_window(config) -> int:
    """The context a model was pretrained on: the `original_max_position_embeddings` of its RoPE scaling when it has
    one, else `max_position_embeddings`."""
    rope = getattr(config, "rope_parameters", None) or {}
    return int(rope.get("original_max_position_embeddings") or config.max_position_embeddings)


def scaling_overrides(method: str, target_length: int | None, pretrained_length: int) -> dict:
    """The `rope_parameters` changes of a position scaling ("pi": linear interpolation, "yarn") from
    `pretrained_length` to `target_length`; ValueError when it would not extend."""
    factor = scale_factor(FinetuneSettings(method=method, target_length=target_length), pretrained_length)
    if method == "pi":
        return {"rope_type": "linear", "factor": factor}
    if method == "yarn":
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": pretrained_length}
    raise ValueError(f"method={method!r} is not a position scaling; choose one of: {', '.join(SCALED_METHODS)}")


def lora_target_names(model: nn.Module) -> list[str]:
    """Full names of the q/k/v/o projections of every `TapeAttention` module."""
    return [
        f"{name}.{proj}"
        for name, module in model.named_modules()
        if isinstance(module, TapeAttention)
        for proj in LORA_PROJECTIONS
    ]


def _unique(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    seen, out = set(), []
    for param in params:
        if id(param) not in seen:
            seen.add(id(param))
            out.append(param)
    return out


def trainable_groups(model: nn.Module, settings: FinetuneSettings) -> dict[str, list[nn.Parameter]]:
    """The parameters each part of the method trains, found by module type: "tape" (TapeLayer), "lora" (peft
    LoraLayer adapters), "norms" (RMSNorm), "embeddings" (the input embedding; tied to lm_head when the model ties)."""
    from peft.tuners.lora import LoraLayer

    groups: dict[str, list[nn.Parameter]] = {}
    modules = list(model.modules())
    if settings.method == "full":
        return {"all": _unique(model.parameters())}
    if settings.method == "tape":
        groups["tape"] = _unique(p for m in modules if isinstance(m, TapeLayer) for p in m.parameters())
    if settings.lora:
        groups["lora"] = _unique(
            p
            for m in modules
            if isinstance(m, LoraLayer)
            for adapters in (m.lora_A, m.lora_B)
            for p in adapters.parameters()
        )
    if settings.train_norms:
        groups["norms"] = _unique(p for m in modules if isinstance(m, RMSNorm) for p in m.parameters())
    if settings.train_embeddings:
        groups["embeddings"] = [model.get_input_embeddings().weight]
    return groups


def prepare(model: TapeForCausalLM, settings: FinetuneSettings):
    """Wrap `model` with LoRA when the method uses it, freeze everything else but the method's trainable set.

    Returns (model to train, {group: parameters})."""
    if settings.lora:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=settings.lora_rank,
            lora_alpha=settings.lora_alpha,
            lora_dropout=0.0,
            target_modules=lora_target_names(model),
            bias="none",
        )
        model = get_peft_model(model, config)
    for param in model.parameters():
        param.requires_grad_(False)
    groups = trainable_groups(model, settings)
    for params in groups.values():
        for param in params:
            param.requires_grad_(True)
    return model, groups


def merge(model) -> TapeForCausalLM:
    """The plain `TapeForCausalLM` with any LoRA adapter merged into its weights."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        model = model.merge_and_unload()
    for param in model.parameters():
        param.requires_grad_(False)
    return model.eval()


@dataclass
class FinetuneResult:
    model: TapeForCausalLM
    trainable: dict[str, int] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    seconds_per_step: float = 0.0


RUN_RECORD = "finetune.json"


def check_run_folder(run_dir: str | Path, settings: FinetuneSettings, source_name: str | None) -> None:
    """ValueError when `run_dir` holds a fine-tuning from another source model or with other settings (resuming
    it would train, or report, one model under another's name)."""
    path = Path(run_dir) / RUN_RECORD
    if not path.exists():
        return
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise ValueError(f"run folder '{run_dir}' has an unreadable {RUN_RECORD}; choose another --out") from None
    if "settings" not in saved:  # written before the source was recorded
        saved = {"source": None, "settings": saved}
    try:
        same_settings = FinetuneSettings(**saved["settings"]) == settings
    except (TypeError, ValueError):
        same_settings = False
    if saved.get("source") != source_name:
        previous = saved.get("source") or "an unrecorded source model"
        raise ValueError(
            f"run folder '{run_dir}' holds a fine-tuning of {previous}, not of {source_name}; choose another --out"
        )
    if not same_settings:
        changed = sorted(k for k, v in settings.to_dict().items() if saved["settings"].get(k, v) != v)
        raise ValueError(
            f"run folder '{run_dir}' holds a fine-tuning with other settings (different "
            f"{', '.join(changed) or 'settings'}); choose another --out"
        )


def finetune(
    source,
    tokenizer,
    settings: FinetuneSettings,
    run_dir: str | Path,
    resume: bool = True,
    batch_stream=None,
    progress: bool = True,
    stop_after: int | None = None,
    source_name: str | None = None,
    evaluate_fn=None,
) -> FinetuneResult:
    """Build the method's model from `source`, train it with `tapelm.training.loop.train` on real text (or
    `batch_stream`), merge LoRA and save the merged model and tokenizer to `run_dir/merged`. Resumes from `run_dir`'s
    checkpoints when they are a fine-tuning of the same `source_name` (the model's name, recorded in RUN_RECORD)
    with the same settings; ValueError otherwise. `evaluate_fn(model, step)`: called every `settings.eval_every`
    steps (see `tapelm.training.loop.train`)."""
    from ..training.loop import LoopOptions, train

    run_dir = Path(run_dir)
    check_run_folder(run_dir, settings, source_name)
    torch.manual_seed(settings.seed)
    model = build_model(source, settings)
    model, groups = prepare(model, settings)
    params = _unique(p for group in groups.values() for p in group)
    if batch_stream is None:
        from .data import TrainingText

        batch_stream = TrainingText.build(
            tokenizer,
            settings.train_length,
            settings.train_tokens,
            settings.batch_size,
            settings.seed,
            prose=settings.prose_corpus,
        )
    train_settings = settings.train_settings()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_RECORD).write_text(json.dumps({"source": source_name, "settings": settings.to_dict()}, indent=2))
    has_run = (run_dir / "settings.json").exists()
    with _s2_context(model, settings):
        outcome = train(
            model,
            batch_stream,
            train_settings,
            run_dir,
            evaluate_fn=evaluate_fn,
            resume=resume and has_run,
            parameters=params,
            options=LoopOptions(progress=progress, stop_after=stop_after, evaluate_last=False),
        )
    trained = outcome.steps - outcome.start_step if stop_after is None else len(outcome.losses)
    result = FinetuneResult(
        merge(model),
        {k: sum(p.numel() for p in v) for k, v in groups.items()},
        outcome.losses,
        outcome.seconds,
        outcome.seconds / max(1, len(outcome.losses) or trained),
    )
    if stop_after is None or stop_after >= settings.steps:
        result.model.save_pretrained(run_dir / "merged")
        if tokenizer is not None:
            tokenizer.save_pretrained(run_dir / "merged")
    return result


def _s2_context(model: nn.Module, settings: FinetuneSettings):
    import contextlib

    if settings.method != "longlora":
        return contextlib.nullcontext()
    from .longlora import shifted_sparse_attention

    return shifted_sparse_attention(model, settings.s2_group())
