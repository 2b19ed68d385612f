"""The report section of the compute ladder (`tapelm ladder TASK --predict docs/results/ladder`): per task, its rungs'
TAPE - RoPE differences beyond the training length against compute, the trend's prediction for the GPU recipe as it
was written (dated, with its commit), the backtest (the highest CPU rung predicted from the others, and scored), and,
once `tapelm stage` has archived the GPU comparison, whether the GPU result fell inside the predicted interval."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..analysis.plots import _pyplot
from ..analysis.statistics import interval
from ..experiments import ladder
from .sections import ReportContext, register_section


def predictions_dir(context: ReportContext) -> Path:
    return Path(context.figures).parent / "results" / "ladder"


def _point(axis, x: float, stats: dict[str, float], **style) -> None:
    """A difference (`mean` and `half_width` as fractions) drawn in points with its interval."""
    axis.errorbar(x, stats["mean"] * 100, yerr=stats["half_width"] * 100, **style)


def _figure(record: dict[str, Any], observed: dict[int, float], path: Path) -> Path:
    plt = _pyplot()
    prediction = record["prediction"]
    fig, axis = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
    for rung in record["rungs"]:
        _point(axis, rung["compute"], interval(list(rung["differences"].values())), fmt="o", color="C0")
    xs = [min(r["compute"] for r in record["rungs"]), prediction["at"]]
    line = [(prediction["slope_per_decade"] * math.log10(x) + prediction["intercept"]) * 100 for x in xs]
    axis.plot(xs, line, color="C0", linestyle="--", label="trend of the CPU rungs")
    _point(axis, prediction["at"], prediction, fmt="s", color="C1", label="predicted GPU rung (95%)")
    tested = ladder.backtest(record["rungs"])
    if tested is not None:
        label = f"backtest: the {tested['held_out']:g}x rung predicted from the others (95%)"
        held_out = tested["prediction"]
        _point(axis, held_out["at"], held_out, fmt="^", color="C3", mfc="none", capsize=3, label=label)
    if observed:
        _point(
            axis, prediction["at"], interval(list(observed.values())), fmt="D", color="C2", label="GPU rung measured"
        )
    axis.axhline(0, color="grey", linewidth=0.8)
    axis.set_xscale("log")
    axis.set_xlabel("training FLOPs of a RoPE run (log scale)")
    axis.set_ylabel("TAPE - RoPE beyond the training length (points)")
    axis.set_title(f"{record['task']}: the compute ladder", fontsize=10)
    axis.legend(fontsize=8, loc="lower left")
    axis.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _prediction(record: dict[str, Any], observed: dict[int, float]) -> str:
    """The prediction as it was written, and its score once the GPU rung has run."""
    task, prediction = record["task"], record["prediction"]
    text = (
        f"Predicted on {record['date']} at commit `{record['commit'][:10]}`, before any GPU rung of {task} ran: "
        f"at the GPU recipe's {prediction['at']:.3g} FLOPs, TAPE - RoPE = {prediction['mean'] * 100:+.1f} points, "
        f"95% interval [{prediction['low'] * 100:+.1f}, {prediction['high'] * 100:+.1f}] (a line in log compute "
        f"through {prediction['points']} per-seed differences; {prediction['slope_per_decade'] * 100:+.1f} points "
        "per tenfold compute)."
    )
    if not observed:
        return text + " The GPU rung has not run yet."
    stats = interval(list(observed.values()))
    return text + (
        f" Measured on the GPU: {stats['mean'] * 100:+.1f} ± {stats['half_width'] * 100:.1f} points "
        f"({stats['n']} seeds): **{ladder.scored(prediction, stats['mean'])} the predicted interval**."
    )


def _backtest(record: dict[str, Any]) -> str:
    """The backtest (`ladder.backtest`) in one sentence."""
    tested = ladder.backtest(record["rungs"])
    if tested is None:
        return "Backtest: fewer than three CPU rungs, nothing to hold out yet."
    held_out = tested["prediction"]
    return (
        f"Backtest: the line through the rungs below {tested['held_out']:g}x predicts it at "
        f"{held_out['mean'] * 100:+.1f} points, 95% interval [{held_out['low'] * 100:+.1f}, "
        f"{held_out['high'] * 100:+.1f}]; it measured {tested['observed'] * 100:+.1f} (error "
        f"{tested['error'] * 100:+.1f} points): **{tested['scored']} the interval**."
    )


def _drawn(record: dict[str, Any], observed: dict[int, float], context: ReportContext) -> str:
    """Draw the task's figure into the figures folder; its file name."""
    context.figures.mkdir(parents=True, exist_ok=True)
    name = f"ladder-{record['task']}.png"
    _figure(record, observed, context.figures / name)
    return name


def _subsection(record: dict[str, Any], context: ReportContext) -> str:
    task = record["task"]
    lines = [
        f"### {task}",
        "",
        "| rung | training FLOPs (RoPE) | x laptop | TAPE - RoPE beyond the training length (points) | seeds |",
        "|---|---|---|---|---|",
    ]
    for rung in record["rungs"]:
        stats = interval(list(rung["differences"].values()))
        lines.append(
            f"| {rung['nominal']:g}x | {rung['compute']:.3g} | {rung['factor']:.2f} | "
            f"{stats['mean'] * 100:+.1f} ± {stats['half_width'] * 100:.1f} | {stats['n']} |"
        )
    observed = ladder.gpu_differences(context.comparisons, task)
    name = _drawn(record, observed, context)
    return (
        "\n".join(lines)
        + "\n\n"
        + _prediction(record, observed)
        + "\n\n"
        + _backtest(record)
        + f"\n\n![{task} compute ladder]({context.figures_link}/{name})"
    )


def build(context: ReportContext) -> str | None:
    records = [json.loads(path.read_text()) for path in sorted(predictions_dir(context).glob("*.json"))]
    if not records:
        return None
    intro = (
        "Does TAPE's lead over RoPE grow, hold or vanish with compute? Each rung is a TAPE/RoPE comparison on the "
        "CPU between the laptop recipe and the GPU recipe (`tapelm ladder`, the rule in docs/RECIPES.md); the trend "
        "of the paired difference against log compute is extrapolated to the GPU recipe and committed before the "
        "GPU runs it."
    )
    return "\n\n".join([intro, *(_subsection(record, context) for record in records)])


register_section("compute-ladder", "The compute ladder: a prediction, then its test", build)

__all__ = ["build"]
