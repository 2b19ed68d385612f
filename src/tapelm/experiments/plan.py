"""The comparisons tapelm owes its users (the issues "Comparisons that learn" and "Ablations, faithful baselines"):
per task, the rows (encodings, or TAPE's variants) and how many seeds each needs at the default preset's recipe, or
at a design of the task given as options over it (addition with index hints, issue "Arithmetic that can show
extrapolation").
`tapelm report` writes which are complete into docs/RESULTS.md, with the command that runs what is missing; since
finished runs are cached, and archived by the report (`--archive`), that command continues a comparison across
sessions and machines."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from .presets import DEFAULT_PRESET, PRESETS, gpu_schedule
from .runs import RunSpec, option_flags, settings_hash
from .variants import ABLATIONS

PAPER_FIVE = ("tape", "rope", "randpe", "nope", "fire")  # the paper's addition table
OTHER_ENCODINGS = ("xpos", "alibi", "t5", "cope", "sinusoidal", "learned")
WITH_ALIBI = (*PAPER_FIVE, "alibi")
CONTEXTUAL = ("tape", "fox", "path", "grape-m", "grape-ap")  # TAPE and the contextual peers


def default_settings_hash(task: str) -> str:
    """The comparison folder's name at the default preset (where `tapelm compare TASK` writes; every encoding of a
    comparison shares it)."""
    return settings_hash(RunSpec(task=task, pe="tape"))


def superseded_by(task: str, preset: str, settings_hash: str) -> str | None:
    """The default preset's current settings hash for `task` when a comparison of that preset at `settings_hash` was
    run at other settings (an older recipe, or options given on the command line) than the preset's or an owed
    design's (see OWED); None otherwise."""
    if preset != DEFAULT_PRESET:
        return None
    current = default_settings_hash(task)
    owed = {owed.settings_hash() for owed in OWED if owed.task == task}
    return None if settings_hash in owed | {current} else current


@dataclass(frozen=True)
class OwedComparison:
    task: str
    rows: tuple[str, ...]
    seeds: int  # seeds 0 .. seeds-1 of every row
    label: str
    ablation: bool = False
    task_options: tuple[tuple[str, object], ...] = ()  # over the preset's (a design of the task)
    train_options: tuple[tuple[str, object], ...] = ()  # over the preset's (that design's recipe)
    preset: str = DEFAULT_PRESET

    def spec(self) -> RunSpec:
        return RunSpec(
            task=self.task,
            pe="tape",
            preset=self.preset,
            task_options=dict(self.task_options),
            train_options=dict(self.train_options),
        )

    def settings_hash(self) -> str:
        return settings_hash(self.spec())

    def missing(self, finished: dict[str, set[int]]) -> dict[str, int]:
        """The rows that lack some of seeds 0 .. seeds-1, each with how many of them it has."""
        owed = set(range(self.seeds))
        have = {row: len(owed & finished.get(row, set())) for row in self.rows}
        return {row: count for row, count in have.items() if count < self.seeds}

    def command(self, rows: list[str], archive: str | None = None) -> str:
        """The command that runs `rows` on every owed seed (and reuses what is cached, or archived in `archive`)."""
        selection = ["ablate", self.task, "--variants"] if self.ablation else ["compare", self.task, "--pe"]
        return shlex.join(
            [
                "tapelm",
                *selection,
                *rows,
                "--seeds",
                *map(str, range(self.seeds)),
                *option_flags(self.spec()),
                *(["--archive", archive] if archive else []),
            ]
        )


# Addition with index hints learns at half the plain format's steps (docs/RECIPES.md); its ablation table decides
# more claims than the plain format's, where no run goes beyond the training length.
INDEX_HINTS = {"task_options": (("format", "index_hints"),), "train_options": (("steps", 4000),)}

OWED = (
    OwedComparison("addition", PAPER_FIVE, 5, "the paper's five encodings"),
    OwedComparison("addition", PAPER_FIVE, 5, "the paper's five encodings, index hints", **INDEX_HINTS),
    OwedComparison("addition", OTHER_ENCODINGS, 3, "the other encodings"),
    *(
        OwedComparison(task, WITH_ALIBI, 3, "the paper's five and ALiBi")
        for task in ("passkey", "mqar", "flipflop", "text")
    ),
    OwedComparison(
        "word_problem",
        ("tape", "rope", "nope", "fox", "path", "grape-m", "grape-ap"),
        3,
        "TAPE, RoPE, NoPE and the contextual peers",
    ),
    *(
        OwedComparison(task, CONTEXTUAL, 3, "TAPE and the contextual peers")
        for task in ("mqar", "passkey", "flipflop", "text")
    ),
    OwedComparison("addition", tuple(ABLATIONS), 3, "the ablation table, index hints", ablation=True, **INDEX_HINTS),
    OwedComparison("passkey", tuple(ABLATIONS), 3, "the ablation table", ablation=True),
)

# The claims at GPU scale (`tapelm stage`), cheapest first (by a RoPE run's training FLOPs, so by its predicted GPU
# seconds; a test holds the order): MQAR (an effect at laptop scale: it validates the pipeline), passkey, language
# modelling, addition with index hints (at half the plain format's steps, as on the laptop), the paper's addition.
# The stage runs every claim's TAPE/RoPE pair in this order before any other encoding.
GPU = "gpu"
AT_GPU_SCALE = (
    OwedComparison("mqar", WITH_ALIBI, 3, "the paper's five and ALiBi", preset=GPU),
    OwedComparison("passkey", WITH_ALIBI, 3, "the paper's five and ALiBi", preset=GPU),
    OwedComparison("text", WITH_ALIBI, 3, "the paper's five and ALiBi", preset=GPU),
    OwedComparison(
        "addition",
        PAPER_FIVE,
        3,
        "the paper's five encodings, index hints",
        preset=GPU,
        task_options=INDEX_HINTS["task_options"],
        train_options=tuple(gpu_schedule(PRESETS[GPU]["addition"].train.steps // 2).items()),
    ),
    OwedComparison("addition", PAPER_FIVE, 3, "the paper's five encodings", preset=GPU),
)


def at_laptop_scale(owed: OwedComparison) -> OwedComparison:
    """The laptop comparison (default preset) of a comparison's task and design: the one its recipe scales."""
    return next(o for o in OWED if (o.task, o.task_options, o.ablation) == (owed.task, owed.task_options, False))


__all__ = [
    "AT_GPU_SCALE",
    "CONTEXTUAL",
    "GPU",
    "INDEX_HINTS",
    "OWED",
    "OTHER_ENCODINGS",
    "OwedComparison",
    "PAPER_FIVE",
    "WITH_ALIBI",
    "at_laptop_scale",
    "default_settings_hash",
]
