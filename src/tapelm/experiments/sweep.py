"""`tapelm sweep TASK --pe P... --seeds S... --lr ... [--schedule ...]`: learning curves over a grid of encodings,
seeds, learning rates and schedules, from which a preset's recipe is chosen — a recipe that learns must learn on
every seed, so the grid has seeds. Each run records its in-distribution metric every `--eval-every` steps; the curves
and the final evaluations go to one JSON and one PNG (a panel per encoding), so the choice can be checked and redone.
Runs are cached per settings under ROOT/sweep/TASK/PE/, like comparisons.
"""

from __future__ import annotations

import itertools
import json
import logging
import shlex
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..training.atomic import write_json_atomically
from ..training.launchers import Log
from ..training.settings import SCHEDULES
from .runs import RunOptions, RunSpec, option_flags, resolve, run_task

logger = logging.getLogger(__name__)


def learning_curve(run_dir: Path) -> dict[str, list]:
    """(step, loss) and (step, in-distribution metric) pairs from a run's metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evaluations = [(r["step"], next(iter(r["eval"].values()))) for r in records if "eval" in r]
    return {"loss": losses, "in_distribution": evaluations}


def _label(lr: float, schedule: str, seed: int, pe: str) -> str:
    return f"{pe} lr {lr:g} {schedule} seed {seed}"


def sweep(
    base: RunSpec,
    learning_rates: list[float],
    root: str | Path = "runs",
    out: str | Path = "docs/sweeps",
    progress: bool = True,
    pes: list[str] | None = None,
    seeds: list[int] | None = None,
    schedules: list[str] | None = None,
    name: str | None = None,
    compile_layers: bool = False,
    log: Log | None = None,
) -> dict[str, Any]:
    """Train `base` once per (encoding, learning rate, schedule, seed) (cached), then write OUT/NAME.json and .png;
    NAME defaults to TASK-PE[-PE...]-sweep. Encodings, seeds and schedules default to `base`'s. `compile_layers`: see
    `run_task`. `log` receives the progress lines and each run's result (default: this module's logger)."""
    say = log or logger.info
    pes, seeds = pes or [base.pe], seeds if seeds is not None else [base.seed]
    schedules = schedules or [None]
    if not learning_rates or any(lr <= 0 for lr in learning_rates):
        raise ValueError(f"--lr {learning_rates!r} is not allowed; give one or more positive learning rates")
    bad = [s for s in schedules if s is not None and s not in SCHEDULES]
    if bad:
        raise ValueError(f"--schedule {bad[0]!r} is not allowed; choose from: {', '.join(SCHEDULES)}")
    runs = {}
    for pe, lr, schedule, seed in itertools.product(pes, learning_rates, schedules, seeds):
        train_options = {**base.train_options, "lr": lr, **({"schedule": schedule} if schedule else {})}
        run = resolve(replace(base, pe=pe, seed=seed, train_options=train_options))
        runs[_label(lr, run.settings.schedule, seed, pe)] = run
    if not all(run.settings.eval_every for run in runs.values()):
        raise ValueError("a sweep needs in-training evaluations for its curves; pass --eval-every N")
    command = shlex.join(
        [
            "tapelm",
            "sweep",
            base.task,
            "--pe",
            *pes,
            "--seeds",
            *map(str, seeds),
            "--lr",
            *map(str, learning_rates),
            *(["--schedule", *schedules] if schedules[0] else []),
            *(["--name", name] if name else []),
            *option_flags(
                replace(base, train_options={k: v for k, v in base.train_options.items() if k != "schedule"}),
                compile_layers,
            ),
        ]
    )
    entries = {}
    for index, (label, run) in enumerate(runs.items(), 1):
        spec = run.spec
        run_dir = (
            Path(root)
            / "sweep"
            / base.task
            / spec.pe
            / f"lr{run.settings.lr:g}-{run.settings.schedule}-seed{spec.seed}-{run.settings_hash}"
        )
        say(f"[{index}/{len(runs)}] {base.task} / {label} ({run_dir})")
        result = run_task(run, run_dir, RunOptions(progress, compile_layers), resume=True, command=command)
        if result is None:
            continue
        entries[label] = {
            "pe": spec.pe,
            "seed": spec.seed,
            "lr": run.settings.lr,
            "schedule": run.settings.schedule,
            "run_dir": run_dir.relative_to(root).as_posix(),  # in the results cache: a record holds no absolute path
            "curve": learning_curve(run_dir),
            "summary": result["summary"],
            "metric": result["metric"],
            "seconds": result.get("session_seconds"),
            "final_loss": result["final_loss"],
            "environment": result.get("environment"),
        }
    first = next(iter(runs.values()))
    record = {
        "task": base.task,
        "pes": pes,
        "seeds": seeds,
        "command": command,
        "settings": {k: v for k, v in first.identity["train"].items() if k not in ("lr", "schedule", "seed")},
        "model": {
            k: first.identity["model"][k]
            for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        },
        "task_options": first.identity["task_options"],
        "runs": entries,
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (name or f"{base.task}-{'-'.join(pes)}-sweep")
    write_json_atomically(stem.with_suffix(".json"), record)
    _plot(record, stem.with_suffix(".png"))
    for label, entry in entries.items():
        summary = entry["summary"]
        say(
            f"{label}: {entry['metric']} in-distribution {summary['in_distribution']:.4f}, longer "
            f"{summary['longer']:.4f}; final loss {entry['final_loss']:.4f}; {entry['seconds'] / 60:.1f} min"
        )
    say(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")
    return record


def _plot(record: dict[str, Any], path: Path) -> None:
    """Training loss (top) and the in-distribution metric (bottom) against step, a column per encoding; a colour per
    (learning rate, schedule), a line style per seed."""
    from ..analysis.plots import _pyplot

    plt = _pyplot()
    pes = record["pes"]
    fig, axes = plt.subplots(2, len(pes), figsize=(5 * len(pes), 7), squeeze=False)
    settings = sorted({(e["lr"], e["schedule"]) for e in record["runs"].values()})
    colours = {s: f"C{i}" for i, s in enumerate(settings)}
    styles = {seed: style for seed, style in zip(record["seeds"], itertools.cycle(["-", "--", ":", "-."]))}
    perplexity = any(e["metric"] == "perplexity" for e in record["runs"].values())
    for column, pe in enumerate(pes):
        loss_axis, metric_axis = axes[0][column], axes[1][column]
        for entry in (e for e in record["runs"].values() if e["pe"] == pe):
            style = {
                "color": colours[(entry["lr"], entry["schedule"])],
                "linestyle": styles[entry["seed"]],
                "label": f"lr {entry['lr']:g} {entry['schedule']} seed {entry['seed']}",
            }
            if entry["curve"]["loss"]:
                loss_axis.plot(*zip(*entry["curve"]["loss"]), **style)
            if entry["curve"]["in_distribution"]:
                steps, values = zip(*entry["curve"]["in_distribution"])
                metric_axis.plot(steps, values if perplexity else [v * 100 for v in values], marker=".", **style)
        loss_axis.set_yscale("log")
        loss_axis.set_title(pe, fontsize=10)
        loss_axis.set_ylabel("training loss")
        metric_axis.set_xlabel("step")
        if perplexity:
            metric_axis.set_yscale("log")
            metric_axis.set_ylabel("in-distribution perplexity, quick evaluation")
        else:
            metric_axis.set_ylabel("in-distribution metric (%), quick evaluation")
            metric_axis.set_ylim(-2, 102)
        for axis in (loss_axis, metric_axis):
            axis.legend(fontsize=7)
            axis.grid(alpha=0.3)
    fig.suptitle(f"{record['task']}: learning curves", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


__all__ = ["sweep", "learning_curve"]
