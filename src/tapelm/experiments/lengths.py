"""How accuracy falls with length far beyond the training length (issue 65): per encoding, the accuracy at every
evaluated multiple of the training length and its fall per doubling; per family, whether encodings that accumulate
position along the sequence (TAPE, PaTH, GRAPE-M, Selective RoPE) fall faster than those that decay attention with
distance (FoX, stick-breaking, Wall, ALiBi, GRAPE-A, GRAPE-AP).

A run's accuracy at a length is the mean over the conditions drawn as in training but for their length (flip-flop:
the training ignore rate; its sparse and dense splits differ in more than length). The fall of one run is the
least-squares slope of that accuracy against log2(length / training length), over the training length and every
longer one, in accuracy per doubling (negative: it falls). Runs of one seed saw the same training stream and test
sets, so families are compared paired by seed: for each seed, the mean fall of a family's learned members, and the
interval of the difference across seeds. Gated rows ("path-gated") belong to their encoding's family and are compared
only with gated rows: the same question asked with the output gate on."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from ..analysis.statistics import interval, paired_difference, verdict
from ..positional import FAMILIES, encoding_class, is_registered
from ..variants import GATED_SUFFIX, gated_row
from .claims import learned_threshold
from .evaluate import summarize
from .tasks import Task

LONG_MULTIPLIER = 8  # a comparison is "far beyond" when it evaluates at least this multiple of the training length


def family_of(pe: str) -> str | None:
    """The family a registered encoding declares (`PositionalEncoding.family`), gated or not; None for it or for a
    row that is no encoding (a variant)."""
    gated = gated_row(pe)
    encoding = gated[0] if gated else pe
    return encoding_class(encoding).family if is_registered(encoding) else None


def reaches_far(record: Mapping[str, Any]) -> bool:
    """Whether a comparison's record evaluates at LONG_MULTIPLIER times its training length or beyond."""
    return max(record.get("task_options", {}).get("eval_multipliers", (1,))) >= LONG_MULTIPLIER


def by_length(task: Task, result: Mapping[str, Any]) -> dict[int, float]:
    """A run's accuracy per evaluated length (tokens), shortest (the training length) first: its evaluation's
    summary by length (`evaluate.summarize`) over the conditions drawn as in training but for their length."""
    kept = [c for c in result["evaluation"]["conditions"] if task.like_training_but_length(c)]
    return {int(length): value for length, value in summarize(task, kept, result["metric"])["by_length"].items()}


def fall_per_doubling(accuracy: Mapping[int, float]) -> float:
    """The least-squares slope of accuracy against log2(length / shortest length), in accuracy per doubling."""
    lengths = np.array(sorted(accuracy), dtype=float)
    if len(lengths) < 2:
        raise ValueError(f"a fall needs at least two lengths; got {len(lengths)}")
    doublings = np.log2(lengths / lengths[0])
    values = np.array([accuracy[int(length)] for length in lengths])
    return float(np.polyfit(doublings, values, 1)[0])


def encoding_rows(task: Task, results: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per encoding: its family, whether it learned the task in distribution (the mean over seeds at the training
    length reaching the task's threshold), the interval of its accuracy at each length and of its fall, and the
    fall of each seed."""
    floor = learned_threshold(task.name)
    rows = {}
    for pe, by_seed in results.items():
        curves = {seed: by_length(task, result) for seed, result in by_seed.items()}
        lengths = sorted(next(iter(curves.values())))
        falls = {seed: fall_per_doubling(curve) for seed, curve in curves.items()}
        at_training = interval([curve[lengths[0]] for curve in curves.values()])
        rows[pe] = {
            "family": family_of(pe),
            "gated": gated_row(pe) is not None,
            "learned": at_training["mean"] >= floor,
            "lengths": lengths,
            "accuracy": {length: interval([curve[length] for curve in curves.values()]) for length in lengths},
            "fall": interval(list(falls.values())),
            "falls": falls,
        }
    return rows


def family_difference(
    rows: Mapping[str, Mapping[str, Any]], gated: bool = False, among: Collection[str] | None = None
) -> dict[str, Any]:
    """Accumulating minus decaying mean fall per doubling, paired by seed over the families' learned members (gated
    rows or ungated ones; only the encodings `among`, when given), with its interval and verdict: 'better' means
    accumulation falls more slowly, 'worse' faster."""
    members = {
        family: [
            pe
            for pe, row in rows.items()
            if row["family"] == family
            and row["learned"]
            and row["gated"] == gated
            and (among is None or pe.removesuffix(GATED_SUFFIX) in among)
        ]
        for family in FAMILIES
    }
    per_seed = {}
    for family, names in members.items():
        seeds = set.intersection(*(set(rows[pe]["falls"]) for pe in names)) if names else set()
        per_seed[family] = {seed: float(np.mean([rows[pe]["falls"][seed] for pe in names])) for seed in seeds}
    difference = paired_difference(per_seed["accumulating"], per_seed["decaying"])
    return {"members": members, "difference": difference, "verdict": verdict(difference)}


__all__ = ["FAMILIES", "LONG_MULTIPLIER", "encoding_rows", "fall_per_doubling", "family_difference", "reaches_far"]
