"""`tapelm stage`: the comparisons owed at GPU scale (`plan.AT_GPU_SCALE`) run in pieces, a few runs at a time, on a
machine lent for minutes (a GPU visit), each piece continuing where the archive says the last one stopped.

The order decides TAPE against RoPE first: every comparison's TAPE and RoPE runs on all its seeds (the pairs), claim
by claim in the plan's order (cheapest first), and only then the other encodings. In each comparison RoPE's and
TAPE's seed 0 run first, and their quick evaluations are the recipe's learning curves: the other runs wait until both
have learned the task in distribution (`claims.learned`), and where either did not the comparison stays stopped until
its recipe changes.

A stage runs the next planned runs while its time lasts and never starts one that its estimate says it cannot
finish. A run's time is expected from the finished runs of its encoding in its comparison, else from RoPE's there
times the encoding's step cost (measured in finished comparisons, else `budget.step_cost`), else from its FLOPs at
the RoPE rate that GPU runs measured (`budget.current_rate`: this stage's finished runs and the archived GPU runs,
those of the newest code), never from the machine that makes the prediction. Each finished run's small files
(result.json with device and versions, eval.json, metrics.jsonl; no model, no checkpoint) are copied into
OUT/compare as they lie in docs/results/compare, and OUT/stage.json says what ran, what did not fit, what is left and
what each estimate comes from; `tapelm report --root OUT` merges them into the archive, from which the next stage
continues (`--archive`).

A run that a visit's deadline or a SLURM preemption stops mid-way keeps its newest checkpoint in `root` (the gpu
recipes write one every few minutes of training: `Preset.checkpoint_minutes`); the next stage that trains in the same
`root` resumes it from there, and ends it as an unbroken run would. A checkpoint never leaves the machine: on a GPU
visit whose `root` is lost with it, the run starts over (docs/GPU.md).
"""

from __future__ import annotations

import json
import logging
import shlex
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any

from ..training.atomic import write_json_atomically
from ..training.checkpoints import list_checkpoints
from ..training.launchers import LocalLauncher, Log
from .archive import archive_comparison
from .budget import (
    OVERHEAD_SECONDS,
    Rate,
    archived_rates,
    current_rate,
    gpu_budget,
    measured_rate,
    shared_slowdown,
    step_cost,
    step_cost_basis,
    training_flops,
)
from .claims import CLAIMS, learned
from .compare import Comparison, open_comparison
from .launchers import Job
from .plan import AT_GPU_SCALE, OwedComparison, at_laptop_scale
from .runs import RESULT_FILE, RunOptions, RunSpec, option_flags, resolve

logger = logging.getLogger(__name__)

CHECK = ("rope", "tape")  # every claim's pair; seed 0 of these runs first in a comparison: its learning-curve check
MARGIN = 1.15  # a run starts only where this much above its expected time (and OVERHEAD_SECONDS) is left
STAGE_FILE = "stage.json"


@dataclass
class PlannedRun:
    """One run of a planned comparison, and what is known of it: its recorded seconds (train and evaluate, the whole
    run's), whether it learned and the RoPE rate it measured, once finished; where unfinished, the step of the
    checkpoint it resumes from (a deadline or a preemption stopped it) and the fraction of its steps left; the error
    that stopped it in this stage."""

    comparison: int
    pe: str
    seed: int
    seconds: float | None = None
    learned: bool | None = None
    rate: Rate | None = None
    failed: str | None = None
    resumes_from: int = 0
    left: float = 1.0

    @property
    def finished(self) -> bool:
        return self.seconds is not None

    @property
    def pair(self) -> bool:
        return self.pe in CHECK

    @property
    def check(self) -> bool:
        return self.pair and self.seed == 0


def ordered_runs(plan: list[OwedComparison] | tuple[OwedComparison, ...]) -> list[PlannedRun]:
    """The runs of `plan` in the order a stage takes them: comparison by comparison its pair (the check, then RoPE's
    and TAPE's other seeds), then comparison by comparison seed by seed every other row."""
    for owed in plan:
        if not set(CHECK) <= set(owed.rows):
            raise ValueError(
                f"a comparison at GPU scale needs the rows {', '.join(CHECK)} for its learning-curve "
                f"check; '{owed.label}' has {', '.join(owed.rows)}"
            )
    pairs = [
        PlannedRun(index, pe, seed) for index, owed in enumerate(plan) for seed in range(owed.seeds) for pe in CHECK
    ]
    others = [
        PlannedRun(index, pe, seed)
        for index, owed in enumerate(plan)
        for seed in range(owed.seeds)
        for pe in owed.rows
        if pe not in CHECK
    ]
    return pairs + others


@dataclass
class Schedule:
    """The planned runs in order, each comparison's RoPE training FLOPs and the RoPE rates archived GPU runs
    measured: which run comes next, and how long each is expected to take."""

    runs: list[PlannedRun]
    flops: list[float]
    rates: list[Rate]

    def _seconds(self, comparison: int, pe: str) -> list[float]:
        return [r.seconds for r in self.runs if r.finished and (r.comparison, r.pe) == (comparison, pe)]

    def cost(self, pe: str) -> tuple[float, str]:
        """The encoding's time against RoPE's: the largest ratio of their mean seconds in a comparison where both
        finished runs, else the bench's (or its estimate, `budget.step_cost_basis`)."""
        ratios = [
            sum(mine) / len(mine) / (sum(rope) / len(rope))
            for comparison in range(len(self.flops))
            if (mine := self._seconds(comparison, pe)) and (rope := self._seconds(comparison, "rope"))
        ]
        return (max(ratios), "measured") if ratios else (step_cost(pe), step_cost_basis(pe))

    def rate(self) -> Rate:
        """The RoPE rate to predict with, from the finished runs' and the archived ones' (`budget.current_rate`)."""
        return current_rate([*self.rates, *(r.rate for r in self.runs if r.rate is not None)])

    def expected(self, run: PlannedRun) -> tuple[float, str]:
        """Seconds `run` is expected to take to its end (from its checkpoint, where it resumes from one: that share
        of a whole run's, an estimate that counts the whole run's evaluation in the steps), and what that rests on."""
        seconds, basis = self._whole(run)
        if run.resumes_from:
            return (
                seconds * run.left,
                f"{basis}; {run.left:.0%} of it left after its checkpoint at step {run.resumes_from}",
            )
        return seconds, basis

    def _whole(self, run: PlannedRun) -> tuple[float, str]:
        """Seconds a whole run like `run` is expected to take, start to finish, and what that rests on."""
        if own := self._seconds(run.comparison, run.pe):
            return max(own), f"its {len(own)} finished run(s) here"
        cost, source = self.cost(run.pe)
        if rope := self._seconds(run.comparison, "rope"):
            return max(rope) * cost, f"RoPE's runs here x {cost:.2f} ({source})"
        rate = self.rate()
        return (
            self.flops[run.comparison] / rate.flops_per_second * cost,
            f"FLOPs at {rate.flops_per_second:.3g} FLOP/s ({rate.source}) x {cost:.2f} ({source})",
        )

    def estimate(self, run: PlannedRun, slowdown: float = 1.0) -> tuple[float, str]:
        """The seconds a stage must have left to start `run` (OVERHEAD_SECONDS + MARGIN x expected, the expected
        seconds `slowdown` times longer where the run shares its GPU), and their basis."""
        seconds, basis = self.expected(run)
        return OVERHEAD_SECONDS + MARGIN * seconds * slowdown, basis

    def stopped(self, comparison: int) -> str | None:
        """Why a comparison's check failed (RoPE's or TAPE's seed 0 did not learn); None while it has not."""
        unlearned = [r.pe for r in self.runs if r.comparison == comparison and r.check and r.finished and not r.learned]
        if unlearned:
            return f"{' and '.join(unlearned)} seed 0 did not learn the task in distribution: change the recipe"
        return None

    def waiting(self, run: PlannedRun) -> str | None:
        """Why `run` may not start yet (its comparison's check failed or is unfinished; another claim's pair is
        open); None if it may."""
        if run.check:
            return None
        if reason := self.stopped(run.comparison):
            return reason
        if not all(r.finished for r in self.runs if r.comparison == run.comparison and r.check):
            return "waits for RoPE's and TAPE's seed 0 (the recipe's learning-curve check)"
        if not run.pair and any(r.pair and self.stopped(r.comparison) is None for r in self.open_runs()):
            return "waits until every claim has its TAPE/RoPE pair"
        return None

    def open_runs(self, comparison: int | None = None) -> list[PlannedRun]:
        """The runs still to do (of one comparison, or all), in order; a run that failed in this stage is not
        tried again in it."""
        return [
            r
            for r in self.runs
            if not r.finished and not r.failed and (comparison is None or r.comparison == comparison)
        ]

    def startable(self, seconds_left: float, slowdown: float = 1.0) -> Iterator[tuple[PlannedRun, float, str]]:
        """The runs in order that may start and are expected to finish within `seconds_left` (`slowdown` times
        slower where they share a GPU: `budget.shared_slowdown`), with their estimates."""
        for run in self.open_runs():
            if self.waiting(run) is None:
                seconds, basis = self.estimate(run, slowdown)
                if seconds <= seconds_left:
                    yield run, seconds, basis

    def next_run(self, seconds_left: float) -> tuple[PlannedRun, float, str] | None:
        """The first run in order that may start and is expected to finish within `seconds_left`."""
        return next(self.startable(seconds_left), None)

    def minutes_left(self, pairs: bool = False) -> float:
        """The expected GPU minutes of the runs still to do (of the pairs only, or all), stopped comparisons aside."""
        return (
            sum(
                self.expected(run)[0]
                for run in self.runs
                if not run.finished and (run.pair or not pairs) and self.stopped(run.comparison) is None
            )
            / 60
        )

    def prediction(self) -> dict[str, Any]:
        """The plan's predicted GPU minutes against the budgets (`budget.gpu_budget`), the rate they rest on, the gain
        each budget needs where it is exceeded, and apart from them the minutes if the unmeasured gain holds."""
        rate = self.rate()
        minutes = {"pairs": self.minutes_left(pairs=True), "plan": self.minutes_left()}
        budget = gpu_budget()
        gain, what = budget.unmeasured_gain
        return {
            "rate": {"flops_per_second": rate.flops_per_second, "source": rate.source},
            "minutes": minutes,
            "budget_minutes": dict(budget.minutes),
            "gain_needed": {
                part: minutes[part] / budget.minutes[part] for part in minutes if minutes[part] > budget.minutes[part]
            },
            "assuming_unmeasured_gain": {
                "gain": gain,
                "what": what,
                "minutes": {part: value / gain for part, value in minutes.items()},
            },
        }


def claims_of(owed: OwedComparison) -> list[str]:
    """The paper's claims (`claims.CLAIMS`) that a comparison decides: its task and design, its subject and every
    baseline among its rows."""
    summary = {"task": owed.task, "record": {"task_options": dict(owed.task_options)}}
    return [
        claim.name for claim in CLAIMS if claim.fits(summary) and {claim.subject, *claim.baselines} <= set(owed.rows)
    ]


OVERRIDES = ("model_options", "train_options", "eval_n", "eval_batch_size")


def owed_spec(owed: OwedComparison, overrides: dict[str, Any]) -> RunSpec:
    """A planned comparison's run spec, with `overrides` (OVERRIDES) over it: another recipe, so another comparison
    (tests run the plan at tiny sizes this way)."""
    unknown = sorted(set(overrides) - set(OVERRIDES))
    if unknown:
        raise ValueError(f"override '{unknown[0]}' is not allowed; choose from: {', '.join(OVERRIDES)}")
    spec = owed.spec()
    return replace(spec, **{**overrides, "train_options": {**spec.train_options, **overrides.get("train_options", {})}})


def _open(owed: OwedComparison, overrides: dict[str, Any], root: Path, archive: Path | None) -> Comparison:
    spec = owed_spec(owed, overrides)
    seeds = list(range(owed.seeds))
    command = shlex.join(
        ["tapelm", "compare", owed.task, "--pe", *owed.rows, "--seeds", *map(str, seeds), *option_flags(spec)]
    )
    return open_comparison(spec, list(owed.rows), seeds, root, command=command, archive=archive)


def _known(comparison: Comparison, run: PlannedRun, task: str) -> None:
    """Fill in a finished run's seconds, whether it learned and the RoPE rate it measured, from its result.json;
    an unfinished one's checkpoint to resume from (a deadline or a preemption stopped it in an earlier stage)."""
    run_dir = comparison.run_dir(run.pe, run.seed)
    path = run_dir / RESULT_FILE
    if path.exists():
        result = json.loads(path.read_text())
        run.seconds = whole_run_seconds(result)
        run.learned = learned(task, result["metric"], result["summary"]["in_distribution"])
        run.rate = measured_rate(result, f"{task}/{comparison.directory.name}/{run.pe}/seed{run.seed}")
    elif checkpoints := list_checkpoints(run_dir):
        steps = comparison.runs[run.pe, run.seed].settings.steps
        run.resumes_from = checkpoints[-1][0]
        run.left = 1 - run.resumes_from / steps


def whole_run_seconds(result: dict[str, Any]) -> float:
    """A finished run's seconds, start to finish: its last session's, plus the training before it that the
    checkpoint it resumed from recorded (none in a result written before results recorded it)."""
    return float(result["session_seconds"]) + result.get("train_seconds_before_this_session", 0.0)


def _check_arguments(
    budget_seconds: float, out: Path, tasks: list[str] | None, plan: tuple[OwedComparison, ...]
) -> None:
    if isinstance(budget_seconds, bool) or not isinstance(budget_seconds, (int, float)) or not budget_seconds > 0:
        raise ValueError(
            f"budget_seconds={budget_seconds!r} is not allowed; give the seconds the stage may take (a positive number)"
        )
    if out.exists() and not out.is_dir():
        raise ValueError(f"out='{out}' is a file; give a folder for the stage's results")
    known = list(dict.fromkeys(owed.task for owed in plan))
    unknown = [task for task in tasks or [] if task not in known]
    if unknown:
        raise ValueError(f"tasks={unknown[0]!r} is not planned at GPU scale; choose from: {', '.join(known)}")


def run_stage(
    budget_seconds: float,
    out: str | Path,
    plan: tuple[OwedComparison, ...] = AT_GPU_SCALE,
    root: str | Path = "runs",
    archive: str | Path | None = None,
    data_workers: int = 0,
    tasks: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    progress: bool = True,
    dry_run: bool = False,
    launcher=None,
    report_to: tuple[str, ...] = (),
    checkpoint_minutes: float | None = None,
    log: Log | None = None,
) -> int:
    """Run the next runs of `plan` (of `tasks`, or all) for at most `budget_seconds`, training in `root` and copying
    each finished run into `out`/compare; `archive`: the folder whose finished runs count as done (see module
    docstring). `dry_run`: plan and print, train nothing. `launcher` (`launchers`; default: local, one run at a
    time) trains the runs that may start, as many at once as it has slots; `report_to`, `checkpoint_minutes` (None:
    the recipes', every 3 minutes of training in the gpu preset): see `RunOptions`. A run that an earlier stage's
    deadline or a preemption stopped resumes from its checkpoint in `root`, expected to take the share of its steps
    left.
    `log` receives each run's start line and the status table (default: this module's logger). Returns 0, or 1 when
    a run failed."""
    started, say = time.monotonic(), log or logger.info
    out = Path(out)
    options = RunOptions(  # refuses bad ones, as below
        progress, data_workers=data_workers, report_to=report_to, checkpoint_minutes=checkpoint_minutes
    )
    _check_arguments(budget_seconds, out, tasks, plan)
    launcher = launcher or LocalLauncher()
    chosen = [owed for owed in plan if tasks is None or owed.task in tasks]
    runs = ordered_runs(chosen)
    comparisons = [
        _open(owed, overrides or {}, Path(root), None if archive is None else Path(archive)) for owed in chosen
    ]
    for run in runs:
        _known(comparisons[run.comparison], run, chosen[run.comparison].task)
    schedule = Schedule(
        runs,
        [training_flops(c.runs["rope", 0]) for c in comparisons],
        [] if archive is None else archived_rates(Path(archive)),
    )
    record: dict[str, Any] = {
        "budget_seconds": budget_seconds,
        "data_workers": data_workers,
        "dry_run": dry_run,
        "launcher": {"name": launcher.name, "runs_at_once": launcher.slots},
        "runs": [],
        "environment": _environment(),
        "rope_runs": [_rope_run(owed, flops) for owed, flops in zip(chosen, schedule.flops)],
    }
    if not dry_run:
        with launcher.session(options) as session:
            _dispatch(session, launcher, budget_seconds, started, schedule, chosen, comparisons, out, record, say)
    _write(out, record, schedule, chosen, comparisons, started)
    say(format_status(record))
    return 1 if any(run.failed for run in runs) else 0


def _dispatch(
    session,
    launcher,
    budget_seconds: float,
    started: float,
    schedule: Schedule,
    chosen: list[OwedComparison],
    comparisons: list[Comparison],
    out: Path,
    record: dict[str, Any],
    say: Log,
) -> None:
    """Keep the launcher's slots busy: start the runs that may start and fit in the time left, as many as slots are
    free; as each ends, archive it (or note its failure: one run's, e.g. out of memory, stops no other) and start
    what may start now."""
    running: dict[int, tuple[PlannedRun, dict[str, Any], float]] = {}
    slowdown, sharing = shared_slowdown(launcher.per_device)
    while True:
        left = budget_seconds - (time.monotonic() - started)
        free = None if launcher.slots is None else launcher.slots - len(running)
        busy = [run for run, _, _ in running.values()]
        startable = schedule.startable(left, slowdown)
        new = (
            list(islice((found for found in startable if not any(found[0] is r for r in busy)), free))
            if free != 0
            else []
        )
        jobs, entries = [], []
        for run, expected, basis in new:
            comparison, owed = comparisons[run.comparison], chosen[run.comparison]
            say(
                f"== {owed.task} ({owed.label}) / {run.pe} / seed {run.seed}: expected {expected:.0f} s ({basis}; "
                f"{sharing}); {left:.0f} s left"
            )
            entries.append(
                {
                    "task": owed.task,
                    "settings_hash": comparison.directory.name,
                    "pe": run.pe,
                    "seed": run.seed,
                    "expected_seconds": expected,
                    "expected_from": basis,
                    "sharing": sharing,
                    "launcher": launcher.name,
                    "at_once": len(running) + len(new),
                    **({"resumes_from_step": run.resumes_from} if run.resumes_from else {}),
                }
            )
            jobs.append(
                Job(comparison.runs[run.pe, run.seed], comparison.run_dir(run.pe, run.seed), comparison.command)
            )
        for key, (run, _, _), entry in zip(session.start(jobs), new, entries):
            running[key] = (run, entry, time.monotonic())
        if not running:
            return
        outcome = session.landed()
        run, entry, began = running.pop(outcome.index)
        comparison, owed = comparisons[run.comparison], chosen[run.comparison]
        if outcome.error is not None:
            traceback.print_exception(outcome.error)
            run.failed = f"{type(outcome.error).__name__}: {(str(outcome.error).splitlines() or [''])[0][:300]}"
            entry["failed"] = run.failed
        else:
            _known(comparison, run, owed.task)
            archive_comparison(comparison.directory, out / "compare", [(run.pe, run.seed)])
            entry.update(seconds=time.monotonic() - began, session_seconds=run.seconds, learned=run.learned)
        record["runs"].append(entry)
        _write(out, record, schedule, chosen, comparisons, started)


def _rope_run(owed: OwedComparison, flops: float) -> dict[str, Any]:
    """A RoPE run of the comparison: its training FLOPs and those of its laptop comparison's."""
    laptop = resolve(replace(at_laptop_scale(owed).spec(), pe="rope"))
    return {"flops": flops, "laptop_flops": training_flops(laptop)}


def _environment() -> dict[str, Any]:
    from ..training.provenance import environment

    return environment()


def _write(
    out: Path,
    record: dict[str, Any],
    schedule: Schedule,
    chosen: list[OwedComparison],
    comparisons: list[Comparison],
    started: float,
) -> None:
    """stage.json: the record so far; per comparison what is done, what its remaining runs (its pair's apart) are
    expected to take and what the expectation of its next run rests on; the plan's prediction."""
    record["seconds"] = time.monotonic() - started
    record["comparisons"] = []
    for index, (owed, comparison) in enumerate(zip(chosen, comparisons)):
        open_runs = schedule.open_runs(index)
        record["comparisons"].append(
            {
                "label": owed.label,
                "task": owed.task,
                "settings_hash": comparison.directory.name,
                "claims": claims_of(owed),
                "runs": len([r for r in schedule.runs if r.comparison == index]),
                "finished": len([r for r in schedule.runs if r.comparison == index and r.finished]),
                "stopped": schedule.stopped(index),
                "predicted_seconds_left": sum(schedule.expected(run)[0] for run in open_runs),
                "pair_seconds_left": sum(schedule.expected(run)[0] for run in open_runs if run.pair),
                "next": [f"{run.pe}/seed{run.seed}" for run in open_runs[:3]],
                "next_expected_from": schedule.expected(open_runs[0])[1] if open_runs else None,
            }
        )
    record["prediction"] = schedule.prediction()
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomically(out / STAGE_FILE, record)


def format_status(record: dict[str, Any]) -> str:
    """The stage's comparisons as a markdown table: what is done, and the predicted GPU minutes of the rest."""
    lines = [
        "| comparison | claims | settings hash | a RoPE run's training FLOPs (x laptop) | finished | "
        "GPU minutes left: TAPE/RoPE pair, all (predicted) | next |",
        "|---|---|---|---|---:|---:|---|",
    ]
    for c, rope in zip(record["comparisons"], record["rope_runs"]):
        status = f" (stopped: {c['stopped']})" if c["stopped"] else ""
        lines.append(
            f"| {c['task']}, {c['label']} | {', '.join(c['claims'])} | {c['settings_hash']} | "
            f"{rope['flops']:.2e} ({rope['flops'] / rope['laptop_flops']:,.0f}x) | "
            f"{c['finished']} of {c['runs']}{status} | {c['pair_seconds_left'] / 60:.1f}, "
            f"{c['predicted_seconds_left'] / 60:.1f} | {' '.join(c['next'])} |"
        )
    ran = [r for r in record["runs"] if "seconds" in r]
    lines += [
        "",
        f"This stage: {len(ran)} run(s) finished, {len(record['runs']) - len(ran)} failed, in "
        f"{record['seconds']:.0f} of {record['budget_seconds']:.0f} s.",
        "",
        *prediction_lines(record),
    ]
    return "\n".join(lines)


def prediction_lines(record: dict[str, Any]) -> list[str]:
    """What stage.json's prediction says, in words: the minutes left against the budgets, the rate they rest on,
    the gain a budget needs where it is exceeded, and apart, the minutes if the unmeasured gain holds."""
    prediction = record["prediction"]
    minutes, budget, rate = prediction["minutes"], prediction["budget_minutes"], prediction["rate"]
    lines = [
        f"Predicted GPU minutes left: every claim's TAPE/RoPE pair {minutes['pairs']:.1f} (budget "
        f"{budget['pairs']:.0f}), the whole plan {minutes['plan']:.1f} (budget {budget['plan']:.0f}); runs "
        f"without a finished one in their comparison at {rate['flops_per_second']:.3g} RoPE FLOP/s "
        f"({rate['source']})."
    ]
    for part, gain in prediction["gain_needed"].items():
        lines.append(
            f"Over budget: {'the pairs need' if part == 'pairs' else 'the whole plan needs'} {gain:.2f}x "
            "the throughput measured."
        )
    assumed = prediction["assuming_unmeasured_gain"]
    lines.append(
        f"Apart, assuming {assumed['gain']:.0f}x from {assumed['what']}: pairs "
        f"{assumed['minutes']['pairs']:.1f}, whole plan {assumed['minutes']['plan']:.1f} GPU minutes."
    )
    return lines


__all__ = [
    "CHECK",
    "PlannedRun",
    "Schedule",
    "claims_of",
    "format_status",
    "ordered_runs",
    "owed_spec",
    "prediction_lines",
    "run_stage",
]
