"""`tapelm tune TASK --pe P... --seeds S...`: each encoding's own peak learning rate for a task's recipe, by the
protocol of docs/RECIPES.md ("Tuned learning rates"), so that a verdict measures the encoding and not a rate chosen
for another.

- The grid: the recipe's shared rate times FACTOR^k for k = -1, 0, 1, extended by one step (k = -2 or 2) where the
  best lies at an edge; a choice still at the edge of the extended grid is recorded as such (`at_edge`).
- Each rate trains on the tuning seeds (never the comparison's: 100 and 101 by default), everything else the recipe's.
- The score: the task's metric on a validation set at the training length (its in-distribution conditions drawn with
  `VALIDATION_SEED`, never the test set's `EVAL_SEED`, never beyond the training length), its mean over the tuning
  seeds; among rates whose scores round to the same (to `PLACES` decimals, 0.01 points), the lowest validation loss.
- The record: OUT/TASK/HASH.json (HASH: the recipe's settings hash at the shared rate, the comparison's folder name)
  holds every run's score, loss and seconds, each encoding's choice and the CPU seconds in all; encodings tuned
  before are kept.

Runs are cached in ROOT/tune/TASK/HASH/PE/lrLR-seedS and resume as a comparison's do. A synthetic task draws its
validation examples afresh with their own seed; text scores a span of its held-out stream that shares no token with
the test set's (`TextTask`).
"""

from __future__ import annotations

import json
import logging
import shlex
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..analysis.statistics import higher_is_better
from ..training.atomic import write_json_atomically
from ..training.launchers import LocalLauncher, Log
from ..variants import check_row
from .evaluate import VALIDATION_SEED, seeded_torch_rng, summarize
from .launchers import Job
from .runs import RESULT_FILE, ResolvedRun, RunOptions, RunSpec, load_run, option_flags, resolve, settings_hash

logger = logging.getLogger(__name__)

FACTOR = 3.0
TUNING_SEEDS = (100, 101)
PLACES = 4
VALIDATION_FILE = "validation.json"


def grid(shared: float, down: int = 1, up: int = 1) -> list[float]:
    """The rates shared * FACTOR^k for k = -down .. up, lowest first."""
    return [shared * FACTOR**k for k in range(-down, up + 1)]


def extended(shared: float, rates: list[float], best: float) -> list[float] | None:
    """The grid one step wider on the side where `best` lies at the edge of the first grid `rates`; None when it
    lies inside, or when `rates` is already extended."""
    if len(rates) > 3 or best not in (rates[0], rates[-1]):
        return None
    return grid(shared, 2, 1) if best == rates[0] else grid(shared, 1, 2)


def choose(scores: dict[float, list[dict[str, float]]], metric: str) -> float:
    """The rate with the best mean validation score over its seeds ({rate: [{"score", "loss"}, ...]}), ties (the
    same score to PLACES decimals) broken by the lower mean validation loss."""
    sign = 1 if higher_is_better(metric) else -1

    def key(rate: float) -> tuple[float, float]:
        runs = scores[rate]
        score = round(sign * float(np.mean([run["score"] for run in runs])), PLACES)
        return score, -float(np.mean([run["loss"] for run in runs]))

    return max(scores, key=key)


@torch.no_grad()
def validate(model: torch.nn.Module, run: ResolvedRun) -> dict[str, Any]:
    """The run's validation at its training length: the task's metric over the in-distribution conditions drawn with
    VALIDATION_SEED (the preset's number of examples each) and the mean next-token loss on the same examples."""
    model.eval()
    task, device = run.task, next(model.parameters()).device
    n, batch_size = run.preset.eval_n, run.preset.eval_batch_size

    def logits_fn(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
        return out.logits.float()

    conditions, losses = [], []
    with seeded_torch_rng(VALIDATION_SEED, device):
        for condition in (c for c in task.eval_conditions() if task.in_distribution(c)):
            value, count = task.evaluate_condition(logits_fn, condition, VALIDATION_SEED, n, batch_size)
            conditions.append({**condition, "value": value, "n": count})
            for batch in task.eval_batches(condition, VALIDATION_SEED, n, batch_size):
                batch = batch.to(device)
                out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels)
                losses.append(float(out.loss))
    score = summarize(task, conditions, task.metric_name)["in_distribution"]
    return {"seed": VALIDATION_SEED, "n": n, "score": score, "loss": float(np.mean(losses))}


def run_validation(run: ResolvedRun, run_dir: Path) -> dict[str, Any]:
    """The finished run's validation, cached in its folder (recomputed when the set it was drawn from differs)."""
    path = run_dir / VALIDATION_FILE
    if path.is_file():
        cached = json.loads(path.read_text())
        if (cached["seed"], cached["n"]) == (VALIDATION_SEED, run.preset.eval_n):
            return cached
    trained = load_run(run_dir)
    validation = validate(trained.load_model(), trained)
    write_json_atomically(path, validation)
    return validation


def _rate_label(rate: float) -> str:
    return f"{rate:.4g}"


class Tuning:
    """The runs of one tuning: every (encoding, rate, seed), resolved before any is trained, in their folders."""

    def __init__(self, base: RunSpec, pes: list[str], seeds: list[int], root: Path, compile_layers: bool):
        self.base, self.pes, self.seeds = base, pes, seeds
        self.recipe = resolve(base)
        self.shared = self.recipe.settings.lr
        self.hash = settings_hash(base)
        self.directory = root / "tune" / base.task / self.hash
        self.command = shlex.join(
            [
                "tapelm",
                "tune",
                base.task,
                "--pe",
                *pes,
                "--seeds",
                *map(str, seeds),
                *option_flags(base, compile_layers),
            ]
        )

    def run(self, pe: str, rate: float, seed: int) -> ResolvedRun:
        options = {**self.base.train_options, "lr": rate}
        return resolve(replace(self.base, pe=pe, seed=seed, train_options=options))

    def run_dir(self, pe: str, rate: float, seed: int) -> Path:
        return self.directory / pe / f"lr{_rate_label(rate)}-seed{seed}"

    def jobs(self, grids: dict[str, list[float]]) -> list[Job]:
        """The runs of `grids` ({pe: rates}) not finished yet."""
        return [
            Job(self.run(pe, rate, seed), self.run_dir(pe, rate, seed), self.command)
            for pe, rates in grids.items()
            for rate in rates
            for seed in self.seeds
            if not (self.run_dir(pe, rate, seed) / RESULT_FILE).is_file()
        ]

    def scores(self, pe: str, rates: list[float]) -> dict[float, list[dict[str, Any]]]:
        """{rate: [{"seed", "score", "loss", "train_seconds"} per tuning seed]} of the finished runs."""
        found = {}
        for rate in rates:
            found[rate] = []
            for seed in self.seeds:
                run_dir = self.run_dir(pe, rate, seed)
                result = json.loads((run_dir / RESULT_FILE).read_text())
                seconds = result.get("train_seconds_this_session", 0.0) + result.get(
                    "train_seconds_before_this_session", 0.0
                )
                validation = run_validation(self.run(pe, rate, seed), run_dir)
                found[rate].append(
                    {"seed": seed, "score": validation["score"], "loss": validation["loss"], "train_seconds": seconds}
                )
        return found


def _launch(jobs: list[Job], launcher, options: RunOptions, say: Log) -> None:
    for index, job in enumerate(jobs, 1):
        say(
            f"[{index}/{len(jobs)}] {job.run.spec.task} / {job.run.spec.pe} / lr {job.run.settings.lr:.4g} / seed "
            f"{job.run.spec.seed} ({job.run_dir})"
        )
    for outcome in launcher.launch(jobs, options):
        if outcome.error is not None:
            raise outcome.error


def tune(
    base: RunSpec,
    pes: list[str],
    seeds: list[int] | None = None,
    root: str | Path = "runs",
    out: str | Path = "docs/results/tune",
    progress: bool = True,
    launcher=None,
    compile_layers: bool = False,
    data_workers: int = 0,
    report_to: tuple[str, ...] = (),
    log: Log | None = None,
) -> dict[str, Any]:
    """Tune every encoding of `pes` on `base`'s recipe (see the module's protocol) and write OUT/TASK/HASH.json;
    returns the record. ValueError before any run for a bad encoding, seed or task. `launcher` (default: local, one
    run at a time), `compile_layers`, `data_workers`, `report_to`: as `compare`'s."""
    say = log or logger.info
    seeds = list(TUNING_SEEDS) if seeds is None else list(dict.fromkeys(seeds))
    if not pes:
        raise ValueError("give at least one encoding with --pe")
    for pe in pes:
        check_row(pe)
    if not seeds or any(not isinstance(s, int) or s < 0 for s in seeds):
        raise ValueError(f"seeds={seeds!r} is not allowed; give non-negative integers")
    tuning = Tuning(base, list(dict.fromkeys(pes)), seeds, Path(root), compile_layers)
    if not tuning.recipe.task.validation_apart(tuning.recipe.preset.eval_n):
        raise ValueError(
            f"task '{base.task}' has no room for a validation set of {tuning.recipe.preset.eval_n} examples apart from "
            "its test set (its held-out stream is too short); give a larger corpus or a smaller --eval-n"
        )
    launcher = launcher or LocalLauncher(1)
    options = RunOptions(progress, compile_layers, data_workers, report_to)
    metric = tuning.recipe.task.metric_name
    grids = {pe: grid(tuning.shared) for pe in tuning.pes}
    _launch(tuning.jobs(grids), launcher, options, say)
    scores = {pe: tuning.scores(pe, rates) for pe, rates in grids.items()}
    wider = {}
    for pe, rates in grids.items():
        rates = extended(tuning.shared, rates, choose(scores[pe], metric))
        if rates is not None:
            wider[pe] = rates
    _launch(tuning.jobs(wider), launcher, options, say)
    for pe, rates in wider.items():
        scores[pe].update(tuning.scores(pe, [rate for rate in rates if rate not in scores[pe]]))
    record = _record(tuning, grids | wider, scores, metric, Path(out))
    for pe in tuning.pes:
        chosen = record["encodings"][pe]
        edge = " (at the grid's edge)" if chosen["at_edge"] else ""
        say(f"{pe}: lr {chosen['lr']:.4g}{edge}, x{chosen['lr'] / tuning.shared:.3g} the shared {tuning.shared:.4g}")
    return record


def _record(
    tuning: Tuning,
    grids: dict[str, list[float]],
    scores: dict[str, dict[float, list[dict[str, Any]]]],
    metric: str,
    out: Path,
) -> dict[str, Any]:
    """Merge this tuning's encodings (their `grids` and every run's `scores`) into OUT/TASK/HASH.json (written
    atomically) and return the record."""
    path = out / tuning.base.task / f"{tuning.hash}.json"
    previous = json.loads(path.read_text()) if path.is_file() else {}
    encodings = dict(previous.get("encodings", {}))
    for pe, rates in grids.items():
        best = choose(scores[pe], metric)
        encodings[pe] = {
            "lr": best,
            "at_edge": best in (rates[0], rates[-1]) and len(rates) > 3,
            "runs": {_rate_label(rate): scores[pe][rate] for rate in rates},
        }
    seconds = sum(
        run["train_seconds"] for entry in encodings.values() for runs in entry["runs"].values() for run in runs
    )
    record = {
        "task": tuning.base.task,
        "settings_hash": tuning.hash,
        "metric": metric,
        "shared_lr": tuning.shared,
        "factor": FACTOR,
        "seeds": tuning.seeds,
        "validation": {"seed": VALIDATION_SEED, "n": tuning.recipe.preset.eval_n, "conditions": "in-distribution"},
        "commands": list(dict.fromkeys([*previous.get("commands", []), tuning.command])),
        "encodings": dict(sorted(encodings.items())),
        "train_cpu_seconds": seconds,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomically(path, record)
    return record


def tuned_rates(out: str | Path, base: RunSpec, pes: list[str]) -> dict[str, float]:
    """{pe: the rate OUT/TASK/HASH.json chose} for `base`'s recipe; ValueError naming what to run when the record or
    an encoding's choice is missing."""
    recipe = settings_hash(base)
    path = Path(out) / base.task / f"{recipe}.json"
    if not path.is_file():
        raise ValueError(
            f"no tuning of {base.task} `{recipe}` in '{out}' (no {path.name}); run `tapelm tune {base.task} --pe "
            f"{' '.join(pes)}` with the comparison's options first"
        )
    chosen = json.loads(path.read_text())["encodings"]
    missing = [pe for pe in pes if pe not in chosen]
    if missing:
        raise ValueError(
            f"encoding '{missing[0]}' is not tuned for {base.task} `{recipe}`; tuned: {', '.join(chosen)} (run "
            f"`tapelm tune {base.task} --pe {' '.join(missing)}` with the comparison's options)"
        )
    return {pe: chosen[pe]["lr"] for pe in pes}


__all__ = ["FACTOR", "TUNING_SEEDS", "choose", "extended", "grid", "tune", "tuned_rates", "validate"]
