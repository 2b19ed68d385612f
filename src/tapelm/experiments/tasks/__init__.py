"""Seeded synthetic tasks and a text task for length-generalisation experiments.

`get_task(name, **options)` builds a task; `evaluate_task(task, logits_fn, ...)` scores a model on every
evaluation condition of it.
"""

from __future__ import annotations

import inspect

from .addition import AdditionTask
from .base import (
    IGNORE_INDEX,
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
from .tokenization import BPETokenizer, ByteTokenizer, SymbolTokenizer, Tokenizer
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


def get_task(name: str, **options: object) -> Task:
    """The task registered as `name`, built with `options` (its constructor's keyword arguments)."""
    if name not in TASKS:
        raise ValueError(f"unknown task '{name}'; choose one of: {', '.join(TASKS)}")
    allowed = [p for p in inspect.signature(TASKS[name].__init__).parameters if p != "self"]
    for option in options:
        if option not in allowed:
            raise ValueError(f"unknown option '{option}' for task '{name}'; choose from: {', '.join(allowed)}")
    return TASKS[name](**options)


__all__ = [
    "IGNORE_INDEX",
    "TASKS",
    "AdditionTask",
    "BPETokenizer",
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
    "target_accuracy_per_example",
]
