"""SCROLLS (Shaham et al. 2022), the paper's long-context benchmark: data in the release format, prompts as the
paper's fine-tuning code, fine-tuning through tapelm's training loop, cached generation, and SCROLLS' own scoring.

    import tapelm.scrolls
    tapelm.scrolls.score("qasper", {"id1": "yes"}, {"id1": ["Yes.", "no"]})   # {"f1": 100.0, ...}

Commands: `tapelm scrolls finetune | predict | score | laptop` (see `tapelm.scrolls.commands`).
"""

from .data import Example, load_examples, load_rows, references
from .metrics import average_score, normalize_answer, score
from .tasks import ALL_TASKS, LAPTOP_TASKS, PAPER_RESULTS, TASKS, get_task

__all__ = [
    "score",
    "average_score",
    "normalize_answer",
    "load_examples",
    "load_rows",
    "references",
    "Example",
    "TASKS",
    "LAPTOP_TASKS",
    "ALL_TASKS",
    "PAPER_RESULTS",
    "get_task",
]
