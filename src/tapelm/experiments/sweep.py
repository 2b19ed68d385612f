"""`tapelm sweep TASK --pe P --lr ...`: learning curves of one encoding at several learning rates (or any other
training setting held fixed), from which a preset's recipe is chosen. Each run records its in-distribution metric
every `--eval-every` steps; the curves and the final evaluations go to one JSON and one PNG, so the choice can be
checked and redone. Runs are cached per settings under ROOT/sweep/TASK/PE/, like comparisons.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from pathlib import Path
from typing import Any

from .runs import RunSpec, option_flags, resolve, run_task
from .train import write_json_atomically


def learning_curve(run_dir: Path) -> dict[str, list]:
    """(step, loss) and (step, in-distribution metric) pairs from a run's metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evaluations = [(r["step"], next(iter(r["eval"].values()))) for r in records if "eval" in r]
    return {"loss": losses, "in_distribution": evaluations}


def sweep(base: RunSpec, learning_rates: list[float], root: str | Path = "runs", out: str | Path = "docs/sweeps",
          progress: bool = True) -> dict[str, Any]:
    """Train `base` once per learning rate (cached), then write OUT/TASK-PE-sweep.json and .png."""
    if not learning_rates or any(lr <= 0 for lr in learning_rates):
        raise ValueError(f"--lr {learning_rates!r} is not allowed; give one or more positive learning rates")
    runs = {lr: resolve(replace(base, train_options={**base.train_options, "lr": lr})) for lr in learning_rates}
    if not all(run.settings.eval_every for run in runs.values()):
        raise ValueError("a sweep needs in-training evaluations for its curves; pass --eval-every N")
    command = shlex.join(["tapelm", "sweep", base.task, "--pe", base.pe, "--seed", str(base.seed), "--lr",
                          *map(str, learning_rates), *option_flags(base)])
    entries = {}
    for index, (lr, run) in enumerate(runs.items(), 1):
        run_dir = Path(root) / "sweep" / base.task / base.pe / f"lr{lr:g}-{run.settings_hash}"
        print(f"[{index}/{len(runs)}] {base.task} / {base.pe} / lr {lr:g} ({run_dir})", flush=True)
        result = run_task(run, run_dir, resume=True, progress=progress, command=command)
        if result is None:
            continue
        entries[f"{lr:g}"] = {"lr": lr, "run_dir": str(run_dir), "curve": learning_curve(run_dir),
                              "summary": result["summary"], "metric": result["metric"],
                              "seconds": result.get("session_seconds"), "final_loss": result["final_loss"],
                              "environment": result.get("environment")}
    first = next(iter(runs.values()))
    record = {"task": base.task, "pe": base.pe, "seed": base.seed, "command": command,
              "settings": {k: v for k, v in first.identity["train"].items() if k != "lr"},
              "model": {k: first.identity["model"][k] for k in ("hidden_size", "intermediate_size",
                                                                 "num_hidden_layers", "num_attention_heads")},
              "task_options": first.identity["task_options"], "runs": entries}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{base.task}-{base.pe}-sweep"
    write_json_atomically(stem.with_suffix(".json"), record)
    _plot(record, stem.with_suffix(".png"))
    for lr, entry in entries.items():
        summary = entry["summary"]
        print(f"lr {lr}: {entry['metric']} in-distribution {summary['in_distribution']:.4f}, longer "
              f"{summary['longer']:.4f}; final loss {entry['final_loss']:.4f}; {entry['seconds'] / 60:.1f} min")
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")
    return record


def _plot(record: dict[str, Any], path: Path) -> None:
    from .plots import _pyplot

    plt = _pyplot()
    fig, (loss_axis, metric_axis) = plt.subplots(1, 2, figsize=(10, 3.8))
    for lr, entry in record["runs"].items():
        steps, losses = zip(*entry["curve"]["loss"]) if entry["curve"]["loss"] else ((), ())
        loss_axis.plot(steps, losses, label=f"lr {lr}")
        if entry["curve"]["in_distribution"]:
            steps, values = zip(*entry["curve"]["in_distribution"])
            metric_axis.plot(steps, [v * 100 for v in values], marker=".", label=f"lr {lr}")
    loss_axis.set_yscale("log")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("training loss")
    metric_axis.set_xlabel("step")
    metric_axis.set_ylabel("in-distribution metric (%), quick evaluation")
    metric_axis.set_ylim(-2, 102)
    for axis in (loss_axis, metric_axis):
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    fig.suptitle(f"{record['task']} / {record['pe']}: learning curves by learning rate", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["sweep", "learning_curve"]
