"""`tapelm compare TASK --pe ... --seeds ...`: models that differ only in their positional encoding, trained with
identical budgets and evaluated on the same test data; mean ± std across seeds, a markdown table and figures.

Results are cached per (task, encoding, seed, settings hash) in ROOT/compare/TASK/HASH/PE/seedSEED (a finished run
has result.json; an unfinished one resumes from its last checkpoint), so an interrupted comparison continues where it
stopped and a later comparison with more encodings or seeds reuses what is done.
"""

from __future__ import annotations

import json
import math
import shlex
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..config import PE_TYPES
from .evaluate import higher_is_better
from .runs import RESULT_FILE, RunSpec, option_flags, resolve, run_task

COMPARISON_FILE = "comparison.json"
DEFAULT_PES = ("tape", "rope")


def comparison_dir(root: Path, task: str, settings_hash: str) -> Path:
    return Path(root) / "compare" / task / settings_hash


def compare(base: RunSpec, pes: list[str], seeds: list[int], root: str | Path = "runs", progress: bool = True,
            command: str | None = None) -> dict[str, Any]:
    """Run (or reuse) every (encoding, seed) of `base` and aggregate; returns the summary (see `aggregate`)."""
    if not pes:
        raise ValueError("give at least one encoding with --pe")
    unknown = [pe for pe in pes if pe not in PE_TYPES]
    if unknown:
        raise ValueError(f"unknown encoding '{unknown[0]}'; choose from: {', '.join(PE_TYPES)}")
    bad_seeds = [s for s in seeds if not isinstance(s, int) or s < 0]
    if not seeds or bad_seeds:
        raise ValueError(f"seeds={seeds!r} is not allowed; give non-negative integers")
    pes, seeds = list(dict.fromkeys(pes)), list(dict.fromkeys(seeds))
    runs = {(pe, seed): resolve(RunSpec(**{**vars(base), "pe": pe, "seed": seed})) for seed in seeds for pe in pes}
    hashes = {run.settings_hash for run in runs.values()}
    assert len(hashes) == 1, "runs of one comparison share their settings hash"
    directory = comparison_dir(Path(root), base.task, hashes.pop())
    command = command or shlex.join(["tapelm", "compare", base.task, "--pe", *pes, "--seeds", *map(str, seeds),
                                     *(["--root", str(root)] if str(root) != "runs" else []), *option_flags(base)])
    _record(directory, base, pes, seeds, command, next(iter(runs.values())))
    total = len(runs)
    for index, ((pe, seed), run) in enumerate(runs.items(), 1):
        run_dir = directory / pe / f"seed{seed}"
        cached = (run_dir / RESULT_FILE).exists()
        print(f"[{index}/{total}] {base.task} / {pe} / seed {seed}: "
              f"{'cached' if cached else 'running'} ({run_dir})", flush=True)
        started = time.time()
        result = run_task(run, run_dir, resume=True, progress=progress, command=command)
        if not cached and result is not None:
            print(f"    done in {time.time() - started:.0f} s: {result['metric']} all {result['summary']['all']:.4f}",
                  flush=True)
    summary = aggregate(directory)
    print(summary["table"])
    for figure in summary["figures"]:
        print(f"figure: {directory / figure}")
    return summary


def _record(directory: Path, base: RunSpec, pes: list[str], seeds: list[int], command: str, run) -> None:
    """comparison.json: the shared settings and every command that added to this comparison."""
    path = directory / COMPARISON_FILE
    record = json.loads(path.read_text()) if path.exists() else {"commands": [], "pes": [], "seeds": []}
    record.update({"task": base.task, "preset": base.preset, "settings_hash": run.settings_hash,
                   "task_options": run.identity["task_options"], "train": run.identity["train"],
                   "eval": run.identity["eval"], "match_params": base.match_params,
                   "model_options": base.model_options})
    record["pes"] = list(dict.fromkeys([*record["pes"], *pes]))
    record["seeds"] = sorted(set(record["seeds"]) | set(seeds))
    if command not in record["commands"]:
        record["commands"].append(command)
    directory.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(record, indent=1))
    temporary.replace(path)


def _stats(values: list[float]) -> dict[str, float]:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return {"mean": float("nan"), "std": float("nan"), "n": 0}
    return {"mean": float(np.mean(values)), "std": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0,
            "n": len(values)}


def _summary_stats(summaries: list[dict[str, Any]], lengths: list[str]) -> dict[str, Any]:
    return {"all": _stats([s["all"] for s in summaries]),
            "in_distribution": _stats([s["in_distribution"] for s in summaries]),
            "longer": _stats([s["longer"] for s in summaries]),
            "by_length": {x: _stats([s["by_length"][x] for s in summaries]) for x in lengths}}


def load_results(directory: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """{pe: {seed: result + its evaluation}} of the finished runs in a comparison folder."""
    found: dict[str, dict[int, dict[str, Any]]] = {}
    for path in sorted(Path(directory).glob(f"*/seed*/{RESULT_FILE}")):
        result = json.loads(path.read_text())
        result["evaluation"] = json.loads((path.parent / "eval.json").read_text())
        found.setdefault(result["pe"], {})[result["seed"]] = result
    return found


def aggregate(directory: Path, write: bool = True) -> dict[str, Any]:
    """Mean ± std across seeds per encoding, from the cached results; writes summary.json, table.md and figures
    into the comparison folder (when `write`)."""
    directory = Path(directory)
    record = json.loads((directory / COMPARISON_FILE).read_text())
    results = load_results(directory)
    order = [pe for pe in record["pes"] if pe in results] + sorted(set(results) - set(record["pes"]))
    rows = {}
    for pe in order:
        by_seed = results[pe]
        first = next(iter(by_seed.values()))
        lengths = list(first["summary"]["by_length"])
        rows[pe] = {"seeds": sorted(by_seed), "parameters": first["parameters"],
                    **_summary_stats([r["summary"] for r in by_seed.values()], lengths),
                    "final_loss": _stats([r["final_loss"] for r in by_seed.values()]),
                    "seconds": _stats([r.get("session_seconds") for r in by_seed.values()])}
        if all(r.get("token_accuracy_summary") for r in by_seed.values()):
            rows[pe]["token_accuracy"] = _summary_stats([r["token_accuracy_summary"] for r in by_seed.values()],
                                                        lengths)
    any_result = next((r for by_seed in results.values() for r in by_seed.values()), None)
    metric = any_result["metric"] if any_result else "?"
    evaluation = any_result["evaluation"] if any_result else None
    summary = {"task": record["task"], "settings_hash": record["settings_hash"], "metric": metric,
               "record": record, "rows": rows, "figures": [],
               "x_label": evaluation["x_label"] if evaluation else "", "training_edge":
               evaluation["training_edge"] if evaluation else None,
               "missing": [f"{pe}/seed{s}" for pe in record["pes"] for s in record["seeds"]
                           if s not in results.get(pe, {})]}
    summary["table"] = format_table(summary)
    if write and results:
        summary["figures"] = write_figures(summary, results, directory)
        (directory / "table.md").write_text(summary["table"] + "\n")
        (directory / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _format(stats: dict[str, float], metric: str) -> str:
    if stats["n"] == 0:
        return "–"
    if metric == "perplexity":
        return f"{stats['mean']:.3f} ± {stats['std']:.3f}" if stats["n"] > 1 else f"{stats['mean']:.3f}"
    mean, std = stats["mean"] * 100, stats["std"] * 100
    return f"{mean:.1f} ± {std:.1f}" if stats["n"] > 1 else f"{mean:.1f}"


def format_table(summary: dict[str, Any]) -> str:
    """Markdown: one row per encoding; in-distribution, longer, all, and per length (passkey, text)."""
    metric, rows = summary["metric"], summary["rows"]
    unit = "" if metric == "perplexity" else " (%)"
    per_length = summary["task"] != "addition"
    lengths = list(next(iter(rows.values()))["by_length"]) if rows else []
    header = ["encoding", "params", "seeds", f"in-distribution{unit}", f"longer{unit}", f"all{unit}"]
    if per_length:
        header += [f"len {x}" for x in lengths]
    tokens = all("token_accuracy" in row for row in rows.values()) and bool(rows)
    if tokens:
        header += ["token acc. in-distribution (%)", "token acc. longer (%)"]
    header += ["final train loss"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 2 + "---:|" * (len(header) - 2)]
    for pe, row in rows.items():
        cells = [pe, f"{row['parameters'] / 1e6:.3f}M", ",".join(map(str, row["seeds"])),
                 _format(row["in_distribution"], metric), _format(row["longer"], metric), _format(row["all"], metric)]
        if per_length:
            cells += [_format(row["by_length"][x], metric) for x in lengths]
        if tokens:
            cells += [_format(row["token_accuracy"]["in_distribution"], "accuracy"),
                      _format(row["token_accuracy"]["longer"], "accuracy")]
        loss = row["final_loss"]
        cells.append(f"{loss['mean']:.3f}" if loss["n"] else "–")
        lines.append("| " + " | ".join(cells) + " |")
    direction = "higher" if higher_is_better(metric) else "lower"
    lines.append("")
    lines.append(f"{metric.replace('_', ' ')}, {direction} is better; mean ± std (sample std) across seeds."
                 + (" Token accuracy: the share of answer tokens predicted right (teacher-forced), from the same "
                    "logits." if tokens else ""))
    return "\n".join(lines)


def write_figures(summary: dict[str, Any], results: dict[str, dict[int, dict[str, Any]]],
                  directory: Path, prefix: str = "") -> list[str]:
    """Heatmaps (addition) and the metric-against-length curves; returns the file names written."""
    from .plots import curves, heatmap_grid, heatmaps

    task, metric = summary["task"], summary["metric"]
    names = []
    tokens = all("token_accuracy" in row for row in summary["rows"].values())
    if task == "addition":
        variants = [("value", "exact match", "")] + ([("token_accuracy", "token accuracy", "-tokens")]
                                                      if tokens else [])
        for field, label, suffix in variants:
            grids = {}
            for pe in summary["rows"]:
                cells = [[{**c, "value": c[field]} for c in r["evaluation"]["conditions"]]
                         for r in results[pe].values()]
                grids[pe] = np.mean([heatmap_grid(c) for c in cells], axis=0)
            name = f"{prefix}{task}-heatmaps{suffix}.png"
            heatmaps(grids, directory / name, f"{task}: {label} per operand-length cell (mean over seeds; dashed: "
                                              "training range)", edge=summary["training_edge"], label=label)
            names.append(name)
    variants = [(lambda row: row, metric, "")]
    if tokens:
        variants.append((lambda row: row["token_accuracy"], "token_accuracy", "-tokens"))
    for pick, label, suffix in variants:
        series = {}
        for pe, row in summary["rows"].items():
            by_length = pick(row)["by_length"]
            series[pe] = ([float(x) for x in by_length], [s["mean"] for s in by_length.values()],
                          [s["std"] for s in by_length.values()])
        name = f"{prefix}{task}-by-length{suffix}.png"
        curves(series, directory / name, f"{task}: {label.replace('_', ' ')} against length (mean ± std over "
                                         "seeds)", summary["x_label"], label, edge=summary["training_edge"])
        names.append(name)
    return names


__all__ = ["compare", "aggregate", "format_table", "load_results", "comparison_dir", "write_figures"]
