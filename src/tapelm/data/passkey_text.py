"""The passkey document's text (TAPE.md §7): the task line, the filler sentences, the key line and the question, as
both the synthetic passkey task and the pretrained models' passkey evaluation write them. Keys are uniform in
[KEY_LOW, KEY_HIGH)."""

from __future__ import annotations

TASK_LINE = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there."
)
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
LABELS = ("red", "blue", "green", "yellow", "purple", "orange", "white", "black")
KEY_LOW, KEY_HIGH = 1, 50000


def key_line(key: int, label: str | None) -> str:
    if label is None:
        return f"The pass key is {key}. Remember it. {key} is the pass key."
    return f"The pass key for {label} is {key}. Remember it. {key} is the pass key for {label}."


def question(label: str | None) -> str:
    if label is None:
        return "What is the pass key? The pass key is"
    return f"What is the pass key for {label}? The pass key for {label} is"


def compose(needles: list[tuple[float, str]], query: str, answer: str, length: int) -> str:
    """The prompt: task line, filler with each (depth, line) needle inserted, then `query`.

    Adds whole filler sentences while prompt + answer stay within `length` bytes (none if nothing fits).
    """
    budget = length - len(" ".join([TASK_LINE, *(line for _, line in needles), query])) - len(answer)
    filler: list[str] = []
    while budget >= len(FILLER[len(filler) % len(FILLER)]) + 1:
        filler.append(FILLER[len(filler) % len(FILLER)])
        budget -= len(filler[-1]) + 1
    slots = [round(depth * len(filler)) for depth, _ in needles]
    body: list[str] = []
    for index in range(len(filler) + 1):
        body += [line for slot, (_, line) in zip(slots, needles) if slot == index]
        body += filler[index : index + 1]
    return " ".join([TASK_LINE, *body, query])


__all__ = ["TASK_LINE", "FILLER", "LABELS", "KEY_LOW", "KEY_HIGH", "key_line", "question", "compose"]
