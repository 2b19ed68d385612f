"""Prompts as the paper's SCROLLS fine-tuning code builds them (VITA-Group/TAPE, finetune_scrolls.py and
generate_scrolls.py), for any context length.

- Summaries (qmsum, summ_screen_fd, gov_report): `"Context:\\n" + document + "\\n Please summarize this report:"`;
  when it is too long the head of the document is kept and the instruction is always kept whole (the paper keeps
  the first 7,184 tokens and the instruction's last 7 at 8,192).
- QA and NLI: the released input (question, then the document), head kept (the paper: the first 7,991 tokens).
- Room is always left for the capped target plus an end-of-sequence token: prompt <= context - target_cap - 1, so
  generating up to target_cap tokens never exceeds the context (8,192 = 7,184 + 7 + 1,000 + 1 = 7,991 + 200 + 1).
- Training sequences are prompt + target[:target_cap] + eos; the loss covers the target and the eos only.
- Target caps default to the paper's: 1,000 tokens for summaries, 200 for QA / NLI (a preset may lower them).
- A QA / NLI input is the question, a blank line, then the document: `check_document_room` refuses prompts whose
  budget the question fills in every row (the document would be dropped entirely) and counts the rows where it does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..data.examples import Example as TokenExample
from .tasks import ScrollsTask

SUMMARY_PREFIX = "Context:\n"
SUMMARY_INSTRUCTION = "\n Please summarize this report:"
TARGET_CAPS = {"summary": 1000, "qa": 200, "nli": 200}
MIN_DOCUMENT_TOKENS = 1


class Codec(Protocol):
    """What prompting and generation need from a tokenizer."""

    eos_id: int
    pad_id: int

    def encode(self, text: str, first: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class PromptSettings:
    """The context length (tokens of prompt + target + eos) and the target cap (default: the task kind's)."""

    context: int
    target_cap: int | None = None

    def cap(self, task: ScrollsTask) -> int:
        return self.target_cap if self.target_cap is not None else TARGET_CAPS[task.kind]

    def check(self, task: ScrollsTask, codec: Codec) -> None:
        """ValueError when the context cannot hold an instruction, one document token, the cap and the eos."""
        for name in ("context", "target_cap"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}={value!r} is not allowed; it must be a positive integer")
        fixed = (
            len(codec.encode(SUMMARY_PREFIX, first=True)) + len(codec.encode(SUMMARY_INSTRUCTION))
            if task.is_summary
            else 0
        )
        need = fixed + MIN_DOCUMENT_TOKENS + self.cap(task) + 1
        if self.context < need:
            raise ValueError(
                f"context={self.context} is too short for task '{task.name}': it needs at least {need} "
                f"tokens (target_cap={self.cap(task)} + eos + instruction + 1 document token); raise "
                "--context or lower --target-cap"
            )


def prompt_ids(task: ScrollsTask, codec: Codec, text: str, settings: PromptSettings) -> list[int]:
    """The token ids of the prompt for input `text`, truncated to context - target_cap - 1 tokens (see module)."""
    budget = settings.context - settings.cap(task) - 1
    if task.is_summary:
        instruction = codec.encode(SUMMARY_INSTRUCTION)
        head = codec.encode(SUMMARY_PREFIX + text, first=True)
        return head[: budget - len(instruction)] + instruction
    return codec.encode(text, first=True)[:budget]


def document_dropped(task: ScrollsTask, codec: Codec, text: str, settings: PromptSettings) -> bool:
    """Whether the prompt of a QA / NLI input keeps no token of the document that follows its question (the text
    before the first blank line); False for summaries (`PromptSettings.check` keeps their document) and inputs
    without a blank line."""
    question, blank, _ = text.partition("\n\n")
    if task.is_summary or not blank:
        return False
    return len(codec.encode(question + blank, first=True)) >= settings.context - settings.cap(task) - 1


def check_document_room(task: ScrollsTask, codec: Codec, texts: Sequence[str], settings: PromptSettings) -> int:
    """How many of `texts` lose their whole document to truncation; ValueError when every one does."""
    dropped = sum(document_dropped(task, codec, text, settings) for text in texts)
    if texts and dropped == len(texts):
        raise ValueError(
            f"context={settings.context} leaves {settings.context - settings.cap(task) - 1} prompt "
            f"tokens after target_cap={settings.cap(task)} + eos, and the question alone fills them: no "
            "document token would be kept; raise --context or lower --target-cap"
        )
    return dropped


def target_ids(task: ScrollsTask, codec: Codec, output: str, settings: PromptSettings) -> list[int]:
    """The capped target followed by the end-of-sequence token."""
    return codec.encode(output)[: settings.cap(task)] + [codec.eos_id]


def training_example(task: ScrollsTask, codec: Codec, text: str, output: str, settings: PromptSettings) -> TokenExample:
    """prompt + capped target + eos, with the loss on the target and eos only."""
    prompt = prompt_ids(task, codec, text, settings)
    target = target_ids(task, codec, output, settings)
    return TokenExample(prompt + target, [False] * len(prompt) + [True] * len(target))


__all__ = [
    "Codec",
    "PromptSettings",
    "prompt_ids",
    "target_ids",
    "training_example",
    "TARGET_CAPS",
    "document_dropped",
    "check_document_room",
    "SUMMARY_PREFIX",
    "SUMMARY_INSTRUCTION",
]
