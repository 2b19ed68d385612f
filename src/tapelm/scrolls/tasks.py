"""The seven SCROLLS tasks (Shaham et al. 2022): what kind of output each has, how it is scored, and the paper's
numbers (shared/TAPE.md §7) for reference."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("qa", "nli", "summary")


@dataclass(frozen=True)
class ScrollsTask:
    """One task: `kind` decides the prompt and the decoding (summaries: document then an instruction, sampled;
    QA / NLI: the released question-and-document input, greedy); `metric` is SCROLLS' headline score key."""

    name: str
    label: str  # the paper's column name
    kind: str
    metric: str

    @property
    def is_summary(self) -> bool:
        return self.kind == "summary"


TASKS: dict[str, ScrollsTask] = {
    task.name: task
    for task in (
        ScrollsTask("qasper", "QAS", "qa", "f1"),
        ScrollsTask("contract_nli", "CNLI", "nli", "exact_match"),
        ScrollsTask("narrative_qa", "NQA", "qa", "f1"),
        ScrollsTask("quality", "QuAL", "qa", "exact_match"),
        ScrollsTask("qmsum", "QMS", "summary", "rouge/geometric_mean"),
        ScrollsTask("summ_screen_fd", "SumS", "summary", "rouge/geometric_mean"),
        ScrollsTask("gov_report", "GovR", "summary", "rouge/geometric_mean"),
    )
}

# The laptop end-to-end run's two tasks (tapelm.scrolls.laptop): SCROLLS-format data built from the Python standard
# library's sources, scored as SCROLLS scores its QA and summary tasks. They are not SCROLLS tasks.
LAPTOP_TASKS: dict[str, ScrollsTask] = {
    task.name: task
    for task in (
        ScrollsTask("stdlib_docstring_qa", "DocQA", "qa", "f1"),
        ScrollsTask("stdlib_docstring_summary", "DocSum", "summary", "rouge/geometric_mean"),
    )
}
ALL_TASKS: dict[str, ScrollsTask] = {**TASKS, **LAPTOP_TASKS}

# The paper's SCROLLS table (models pretrained at 1,024 tokens, fine-tuned at 8,192), in TASKS order.
PAPER_RESULTS: dict[str, dict[str, float]] = {
    "rope": dict(zip(TASKS, (8.39, 65.00, 1.77, 0.04, 6.34, 5.63, 9.71))),
    "alibi": dict(zip(TASKS, (8.25, 69.62, 4.11, 0.0, 9.92, 9.78, 18.81))),
    "randpe": dict(zip(TASKS, (13.44, 62.01, 4.63, 0.38, 8.43, 8.31, 8.93))),
    "fire": dict(zip(TASKS, (3.41, 71.26, 0.48, 1.25, 8.78, 7.42, 11.03))),
    "xpos": dict(zip(TASKS, (9.02, 71.75, 4.83, 0.24, 10.73, 9.38, 16.38))),
    "tape": dict(zip(TASKS, (11.52, 72.80, 6.79, 11.60, 12.42, 10.34, 15.18))),
}


def get_task(name: str, tasks: dict[str, ScrollsTask] | None = None) -> ScrollsTask:
    """The task called `name`; ValueError naming the allowed names otherwise."""
    tasks = ALL_TASKS if tasks is None else tasks
    if name not in tasks:
        raise ValueError(f"task={name!r} is not allowed; choose one of: {', '.join(tasks)}")
    return tasks[name]


__all__ = ["ScrollsTask", "TASKS", "LAPTOP_TASKS", "ALL_TASKS", "KINDS", "PAPER_RESULTS", "get_task"]
