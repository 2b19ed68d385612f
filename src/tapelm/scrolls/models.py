"""Where a SCROLLS model comes from, with the tokenizer that goes with it.

A source is one of:

- a run directory of `tapelm train --task text` (it has run.json and model/): the model, and the task's own
  tokenizer (bytes, or the BPE the run saved; see `tapelm.experiments.runs.load_run`). These tokenizers have
  no end-of-sequence token, so their padding id ends every target (padding is never attended to or scored, so the
  id is free for that use);
- a `tapelm scrolls finetune` run directory (it has scrolls.json and model/): the fine-tuned model and the tokenizer
  its source had;
- a transformers checkpoint folder of a TapeForCausalLM (e.g. written by `tapelm convert`) with its tokenizer;
- a Llama-family checkpoint folder, a .gguf file or a registered source name (`smollm2-135m`): converted with
  `tapelm.pretrained.from_pretrained_llama` to `pe_type` tape (default) or rope. A tapelm source keeps its own
  encoding: a `pe_type` other than its own is refused.

A fine-tuned run records how to rebuild its tokenizer without paths: a transformers tokenizer is saved in its model
folder; a text run's tokenizer is rebuilt from the text task's options (bytes, or the BPE trained on the same corpus).

Fine-tuning at a context longer than the source's pretraining length can use linear position interpolation
(rope_parameters rope_type "linear", factor = context / pretraining length) for the RoPE family (tape, rope, randpe,
xpos).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import ROTARY_PE_TYPES, TapeConfig
from ..modeling import TapeForCausalLM
from ..training.saved_models import load_saved_model

SCROLLS_RUN_FILE = "scrolls.json"


class TapeTextCodec:
    """A tapelm task tokenizer (bytes or BPE): its padding id doubles as the end-of-sequence token."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_id
        self.eos_id = tokenizer.pad_id

    def encode(self, text: str, first: bool = False) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i != self.pad_id])


class HFCodec:
    """A transformers tokenizer: its BOS (if it adds one) starts the prompt; its EOS ends targets."""

    def __init__(self, tokenizer) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id; SCROLLS targets need an end-of-sequence token")
        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)

    def encode(self, text: str, first: bool = False) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=first)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


@dataclass
class Source:
    """A loaded model with its codec, the pretraining length, and how to rebuild the codec later (`tokenizer`)."""

    model: TapeForCausalLM
    codec: Any
    pretrained_length: int
    tokenizer: dict[str, Any]
    description: str
    hf_tokenizer: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def _text_run_identity(run_dir: Path) -> dict[str, Any]:
    identity = json.loads((run_dir / "run.json").read_text())["identity"]
    if identity.get("task") != "text":
        raise ValueError(
            f"source run '{run_dir}' was trained on task '{identity.get('task')}'; SCROLLS needs a "
            "model trained with `tapelm train --task text` or a pretrained checkpoint"
        )
    return identity


def text_run_codec(run_dir: str | Path) -> TapeTextCodec:
    """The tokenizer of a `tapelm train --task text` run (bytes directly; the BPE the run saved)."""
    return text_task_codec(_text_run_identity(Path(run_dir))["task_options"], run_dir)


def text_task_codec(task_options: dict[str, Any], tokenizer_dir: str | Path) -> TapeTextCodec:
    """The tokenizer of the text task with `task_options` (a text run's identity): bytes, or the BPE saved in
    `tokenizer_dir` (never one trained anew: it would give other ids)."""
    if task_options.get("tokenizer", "byte") == "byte":
        from ..data.tokenization import ByteTokenizer

        return TapeTextCodec(ByteTokenizer())
    from ..data.tokenization import has_saved_tokenizer
    from ..experiments.tasks import get_task

    if not has_saved_tokenizer(tokenizer_dir):
        raise ValueError(
            f"'{tokenizer_dir}' holds no saved tokenizer, and a BPE trained anew would give other ids; "
            "use a run made by this version of tapelm"
        )
    return TapeTextCodec(get_task("text", tokenizer_dir, **task_options).tokenizer)


def codec_from_spec(spec: dict[str, Any], model_dir: Path):
    """Rebuild a codec recorded by `Source.tokenizer`."""
    if spec["kind"] == "tapelm-text-run" and "task_options" in spec:
        return text_task_codec(spec["task_options"], model_dir), None
    if spec["kind"] == "tapelm-text-run":  # recorded by path before the task options were
        if not (Path(spec["run"]) / "run.json").is_file():
            raise ValueError(
                f"the tokenizer of '{model_dir.parent}' is the one of text run '{spec['run']}', which "
                "is not there any more; fine-tune again to record it without a path"
            )
        return text_run_codec(spec["run"]), None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return HFCodec(tokenizer), tokenizer


def interpolated(config: TapeConfig, context: int, pretrained_length: int) -> TapeConfig:
    """`config` with linear position interpolation by context / pretrained_length (RoPE family only)."""
    if config.pe_type not in ROTARY_PE_TYPES:
        raise ValueError(
            f"position interpolation is not allowed for pe_type={config.pe_type!r}; it applies to the "
            f"RoPE family: {', '.join(ROTARY_PE_TYPES)}"
        )
    factor = context / pretrained_length
    if factor <= 1:
        raise ValueError(
            f"position interpolation needs context={context} > the pretraining length "
            f"{pretrained_length}; drop --position-interpolation"
        )
    data = config.to_dict()
    data["rope_parameters"] = {**(config.rope_parameters or {}), "rope_type": "linear", "factor": float(factor)}
    return TapeConfig.from_dict(data)


def _check_context(config: TapeConfig, context: int) -> None:
    if config.pe_type == "learned" and context > config.max_position_embeddings:
        raise ValueError(
            f"context={context} exceeds the learned position table (max_position_embeddings="
            f"{config.max_position_embeddings}); pe_type 'learned' cannot go beyond it"
        )


def _check_pe(pe_type: str | None, config: TapeConfig, where: Path) -> None:
    if pe_type is not None and pe_type != config.pe_type:
        raise ValueError(
            f"--pe {pe_type} does not apply to '{where}': it is a tapelm model with pe_type "
            f"{config.pe_type!r}, kept as it is (--pe only chooses what a Llama-family model is "
            "converted to); drop --pe"
        )


def load_source(
    source: str | Path,
    context: int | None = None,
    position_interpolation: bool = False,
    pretrained_length: int | None = None,
    pe_type: str | None = None,
) -> Source:
    """Load `source` (see the module docstring) for fine-tuning or prediction at `context` tokens. `pe_type`: the
    encoding a Llama-family model is converted to (None: tape); for a tapelm source, None or its own."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one small checkpoint: its loading bar is noise
    try:
        return _load_source(source, context, position_interpolation, pretrained_length, pe_type)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _load_source(source, context, position_interpolation, pretrained_length, pe_type) -> Source:
    path = Path(source).expanduser()
    if path.is_dir() and (path / "run.json").is_file():
        identity = _text_run_identity(path)
        model_dir = path / "model"
        if not (model_dir / "config.json").is_file():
            raise ValueError(
                f"source run '{path}' has no trained model yet (no model/config.json); finish it with "
                "`tapelm train --task text ... --resume`"
            )
        length = pretrained_length or int(identity["task_options"].get("train_length", 256))
        config = TapeConfig.from_pretrained(str(model_dir))
        _check_pe(pe_type, config, path)
        if position_interpolation:
            config = interpolated(config, context or length, length)
        if context is not None:
            _check_context(config, context)
        model = load_saved_model(model_dir, TapeForCausalLM, config=config)
        return Source(
            model,
            text_task_codec(identity["task_options"], path),
            length,
            {"kind": "tapelm-text-run", "task_options": identity["task_options"]},
            f"tapelm text run {path} (pe {config.pe_type}, pretrained at {length} tokens)",
        )
    if path.is_dir() and (path / SCROLLS_RUN_FILE).is_file():
        record = json.loads((path / SCROLLS_RUN_FILE).read_text())
        model_dir = path / "model"
        if not (model_dir / "config.json").is_file():
            raise ValueError(
                f"fine-tuning run '{path}' has no final model yet; finish it with "
                "`tapelm scrolls finetune ... --resume`"
            )
        if position_interpolation:
            raise ValueError("--position-interpolation applies when fine-tuning; a fine-tuned run keeps its own")
        _check_pe(pe_type, TapeConfig.from_pretrained(str(model_dir)), path)
        model = load_saved_model(model_dir, TapeForCausalLM)
        codec, hf_tokenizer = codec_from_spec(record["tokenizer"], model_dir)
        return Source(
            model,
            codec,
            record["pretrained_length"],
            record["tokenizer"],
            f"tapelm scrolls fine-tuning run {path}",
            hf_tokenizer,
            extra=record,
        )
    if (
        path.is_dir()
        and (path / "config.json").is_file()
        and json.loads((path / "config.json").read_text()).get("model_type") == "tape"
    ):
        from transformers import AutoTokenizer

        config = TapeConfig.from_pretrained(str(path))
        _check_pe(pe_type, config, path)
        length = pretrained_length or config.max_position_embeddings
        if position_interpolation:
            config = interpolated(config, context or length, length)
        if context is not None:
            _check_context(config, context)
        model = load_saved_model(path, TapeForCausalLM, config=config)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        return Source(model, HFCodec(tokenizer), length, {"kind": "hf"}, f"tapelm checkpoint {path}", tokenizer)
    from ..conversion import CONVERTIBLE_PE_TYPES, from_pretrained_llama
    from ..pretrained.sources import load_pretrained

    pe_type = pe_type or "tape"
    if pe_type not in CONVERTIBLE_PE_TYPES:
        raise ValueError(
            f"pe={pe_type!r} is not allowed for converting a pretrained model; choose one of: "
            f"{', '.join(CONVERTIBLE_PE_TYPES)}"
        )
    original, tokenizer = load_pretrained(str(source))
    length = pretrained_length or original.config.max_position_embeddings
    overrides = None
    if position_interpolation:
        factor = (context or length) / length
        if factor <= 1:
            raise ValueError(
                f"position interpolation needs context={context} > the pretraining length {length}; "
                "pass --pretrained-length or drop --position-interpolation"
            )
        overrides = {"rope_type": "linear", "factor": float(factor)}
    model = from_pretrained_llama(original, pe_type=pe_type, rope_overrides=overrides).float()
    return Source(model, HFCodec(tokenizer), length, {"kind": "hf"}, f"{source} converted to {pe_type}", tokenizer)


__all__ = [
    "Source",
    "load_source",
    "TapeTextCodec",
    "HFCodec",
    "interpolated",
    "text_run_codec",
    "text_task_codec",
    "codec_from_spec",
    "SCROLLS_RUN_FILE",
]
