"""Seeded synthetic tasks and a text task for length-generalisation experiments.

`get_task(name, **options)` builds a task; `evaluate_task(task, logits_fn, ...)` scores a model on every
evaluation condition of it.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from ...data.tokenization import (
    TOKENIZER_FILE,
    BackendTokenizer,
    ByteTokenizer,
    SymbolTokenizer,
    Tokenizer,
    has_saved_tokenizer,
    is_saved_in,
    load_tokenizer,
    save_tokenizer,
)
from .addition import AdditionTask
from .base import (
    IGNORE_INDEX,
    TEST_SEED,
    VALIDATION_SEED,
    Batch,
    Condition,
    Example,
    SyntheticTask,
    Task,
    collate,
    evaluate_task,
    exact_match_per_example,
    target_accuracy_per_example,
)
from .copying import CopyTask
from .counting import CountingTask
from .flipflop import FlipFlopTask
from .mqar import MQARTask
from .passkey import MultiKeyTask, PasskeyTask
from .selective_copy import SelectiveCopyTask
from .text import TextTask
from .word_problem import WordProblemTask

_ALPHABETICAL = (
    AdditionTask,
    CopyTask,
    CountingTask,
    FlipFlopTask,
    MQARTask,
    MultiKeyTask,
    PasskeyTask,
    SelectiveCopyTask,
    TextTask,
    WordProblemTask,
)
TASKS: dict[str, type[Task]] = {task.name: task for task in _ALPHABETICAL}


def get_task(name: str, saved_tokenizer: str | Path | None = None, /, **options: object) -> Task:
    """The task registered as `name`, built with `options` (its constructor's keyword arguments). `saved_tokenizer`:
    a folder where a run saved its tokenizer (`save_tokenizer`); a task that learns its tokenizer from data loads
    that one instead (see `Task.tokenizer_is_trained`)."""
    if name not in TASKS:
        raise ValueError(f"unknown task '{name}'; choose one of: {', '.join(TASKS)}")
    parameters = inspect.signature(TASKS[name].__init__).parameters.values()
    allowed = [p.name for p in parameters if p.name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD]
    for option in options:
        if option not in allowed:
            raise ValueError(f"unknown option '{option}' for task '{name}'; choose from: {', '.join(allowed)}")
    if saved_tokenizer is not None and TASKS[name].tokenizer_is_trained(options):
        return TASKS[name](**options, saved_tokenizer=saved_tokenizer)
    return TASKS[name](**options)


__all__ = [
    "IGNORE_INDEX",
    "TEST_SEED",
    "VALIDATION_SEED",
    "TASKS",
    "TOKENIZER_FILE",
    "AdditionTask",
    "BackendTokenizer",
    "Batch",
    "ByteTokenizer",
    "Condition",
    "CopyTask",
    "CountingTask",
    "Example",
    "FlipFlopTask",
    "MQARTask",
    "MultiKeyTask",
    "PasskeyTask",
    "SelectiveCopyTask",
    "SymbolTokenizer",
    "SyntheticTask",
    "Task",
    "TextTask",
    "Tokenizer",
    "WordProblemTask",
    "collate",
    "evaluate_task",
    "exact_match_per_example",
    "get_task",
    "has_saved_tokenizer",
    "is_saved_in",
    "load_tokenizer",
    "save_tokenizer",
    "target_accuracy_per_example",
]
