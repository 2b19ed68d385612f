"""Figures: an addition heatmap (exact match per operand-length cell), metric-against-length curves and, per
encoding, panels over training (learning curves, the positional state's norm)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np

LINE_STYLES = ("-", "--", "-.", ":")  # so that lines lying on each other stay visible


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def wrapped(title: str, width_inches: float) -> str:
    """`title` broken into lines that fit a figure `width_inches` wide at the titles' font size."""
    return textwrap.fill(title, width=max(20, int(width_inches * 11)))


def legend_below(fig, axis) -> None:
    """The legend of `axis` under the plot, outside the axes, so it covers no line."""
    handles, labels = axis.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 4), fontsize=8, frameon=False)


def heatmap_grid(conditions: list[dict[str, Any]]) -> np.ndarray:
    """(max len_a, max len_b) array of the conditions' values (NaN where a cell is missing)."""
    size_a = max(c["len_a"] for c in conditions)
    size_b = max(c["len_b"] for c in conditions)
    grid = np.full((size_a, size_b), np.nan)
    for c in conditions:
        grid[c["len_a"] - 1, c["len_b"] - 1] = c["value"]
    return grid


def draw_heatmap(axis, grid: np.ndarray, title: str, edge: float | None = None, label: str = "exact match"):
    image = axis.imshow(
        grid * 100,
        origin="lower",
        vmin=0,
        vmax=100,
        cmap="viridis",
        extent=(0.5, grid.shape[1] + 0.5, 0.5, grid.shape[0] + 0.5),
    )
    if edge is not None:
        axis.plot(
            [0.5, edge + 0.5, edge + 0.5], [edge + 0.5, edge + 0.5, 0.5], color="white", linewidth=1.2, linestyle="--"
        )
    axis.set_xlabel("digits of b")
    axis.set_ylabel("digits of a")
    axis.set_title(f"{title}\nmean {np.nanmean(grid) * 100:.1f}%", fontsize=9)
    return image


def heatmap(conditions: list[dict[str, Any]], path: Path, title: str, edge: float | None = None) -> Path:
    """One heatmap of exact match (%) per (len_a, len_b) cell; the dashed box is the training range."""
    plt = _pyplot()
    fig, axis = plt.subplots(figsize=(5, 4.3), layout="constrained")
    image = draw_heatmap(axis, heatmap_grid(conditions), wrapped(title, 4), edge)
    fig.colorbar(image, ax=axis, label="exact match (%)")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def heatmaps(
    grids: dict[str, np.ndarray], path: Path, title: str, edge: float | None = None, label: str = "exact match"
) -> Path:
    """Heatmaps side by side, one per encoding (each the mean over seeds)."""
    plt = _pyplot()
    count = len(grids)
    columns = min(count, 4)
    rows = -(-count // columns)
    fig, axes = plt.subplots(
        rows, columns, figsize=(3.6 * columns + 1, 3.4 * rows + 0.6), squeeze=False, layout="constrained"
    )
    image = None
    for axis, (name, grid) in zip(axes.flat, grids.items()):
        image = draw_heatmap(axis, grid, name, edge)
    for axis in list(axes.flat)[count:]:
        axis.axis("off")
    fig.suptitle(wrapped(title, 3.6 * columns), fontsize=10)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), label=f"{label} (%)", shrink=0.8)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def curves(
    series: dict[str, tuple[list[float], list[float], list[float] | None]],
    path: Path,
    title: str,
    x_label: str,
    metric: str,
    edge: float | None = None,
) -> Path:
    """Metric against length, one line per series (x, mean, std or None); the dotted line is the training edge."""
    plt = _pyplot()
    fig, axis = plt.subplots(figsize=(6.4, 4.6), layout="constrained")
    for index, (name, (xs, means, stds)) in enumerate(series.items()):
        xs, means = np.asarray(xs, float), np.asarray(means, float)
        shown = means * 100 if metric != "perplexity" else means
        (line,) = axis.plot(
            xs, shown, marker="o", markersize=3, label=name, linestyle=LINE_STYLES[index // 10 % len(LINE_STYLES)]
        )
        if stds is not None:
            spread = np.asarray(stds, float) * (100 if metric != "perplexity" else 1)
            low, high = shown - spread, shown + spread
            if metric != "perplexity":  # an accuracy's spread stops at 0 and 100%
                low, high = np.clip(low, 0, 100), np.clip(high, 0, 100)
            axis.fill_between(xs, low, high, color=line.get_color(), alpha=0.15)
    if edge is not None:
        axis.axvline(edge, color="grey", linestyle=":", linewidth=1)
    if metric == "perplexity":
        axis.set_yscale("log")
        axis.set_ylabel("perplexity (log scale, lower is better)")
    else:
        axis.set_ylabel(f"{metric.replace('_', ' ')} (%)")
        axis.set_ylim(-2, 102)
    if x_label.startswith("evaluation length"):  # lengths grow by multipliers
        axis.set_xscale("log", base=2)
    axis.set_xlabel(x_label)
    axis.set_title(wrapped(title, 6.4), fontsize=10)
    if len(series) > 1:
        legend_below(fig, axis)
    axis.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _panel_grid(count: int):
    """(fig, axes, width): one panel per row of a comparison, at most four across."""
    plt = _pyplot()
    columns = min(count, 4)
    rows = -(-count // columns)
    width = max(4.2 * columns, 6.0)
    fig, axes = plt.subplots(
        rows, columns, figsize=(width, 3.4 * rows + 1.0), squeeze=False, sharey=True, layout="constrained"
    )
    for axis in list(axes.flat)[count:]:
        axis.axis("off")
    return fig, axes, width


def _finish_panels(fig, axes, path: Path, title: str, width: float, y_label: str, legend_axis=None) -> Path:
    """Y labels, the legend of `legend_axis` (default: the first panel) below, the title; saves and closes."""
    for row in axes:
        row[0].set_ylabel(y_label)
    legend_below(fig, axes[0][0] if legend_axis is None else legend_axis)
    fig.suptitle(wrapped(title, width), fontsize=10)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def state_norm_panels(panels: dict[str, tuple[list[int], np.ndarray]], path: Path, title: str) -> Path:
    """One panel per variant: the positional state's norm (relative to E0) at each layer against the training step;
    `panels` maps a variant to (steps, array (steps, layers + 1)), the mean over seeds."""
    fig, axes, width = _panel_grid(len(panels))
    for axis, (name, (steps, norms)) in zip(axes.flat, panels.items()):
        for layer in range(norms.shape[1]):
            label = f"entering layer {layer}" if layer < norms.shape[1] - 1 else "leaving the last layer"
            axis.plot(steps, norms[:, layer], label=label, linestyle=LINE_STYLES[layer % len(LINE_STYLES)])
        axis.set_title(name, fontsize=9)
        axis.set_xlabel("training step")
        axis.grid(alpha=0.3)
    return _finish_panels(fig, axes, path, title, width, "norm of E / norm of E0")


def learning_panels(
    panels: dict[str, dict[str, list[list[float]]]], path: Path, title: str, metric: str, bar: float | None = None
) -> Path:
    """One panel per encoding: its in-distribution metric against the training step, a line per seed; `panels`
    maps an encoding to {seed: [[step, value], ...]}; the dashed line is the bar at which a run counts as learned."""
    perplexity = metric == "perplexity"
    fig, axes, width = _panel_grid(len(panels))
    seeds = sorted({seed for curves in panels.values() for seed in curves}, key=int)
    styles = {seed: (f"C{i % 10}", LINE_STYLES[i // 10 % len(LINE_STYLES)]) for i, seed in enumerate(seeds)}
    for axis, (name, curves) in zip(axes.flat, panels.items()):
        for seed, points in curves.items():
            steps, values = zip(*points)
            shown = values if perplexity else [v * 100 for v in values]
            colour, style = styles[seed]
            axis.plot(steps, shown, marker=".", markersize=3, color=colour, linestyle=style, label=f"seed {seed}")
        if bar is not None and not perplexity:
            axis.axhline(bar * 100, color="grey", linestyle="--", linewidth=1)
        axis.set_title(name, fontsize=9)
        axis.set_xlabel("training step")
        if perplexity:
            axis.set_yscale("log")
        else:
            axis.set_ylim(-2, 102)
        axis.grid(alpha=0.3)
    fullest = max(zip(axes.flat, panels.values()), key=lambda pair: len(pair[1]))[0]  # its legend names every seed
    label = "in-distribution perplexity" if perplexity else f"in-distribution {metric.replace('_', ' ')} (%)"
    return _finish_panels(fig, axes, path, title, width, label, legend_axis=fullest)


OUTCOME_COLOURS = {
    "TAPE ahead": "tab:green",
    "TAPE behind": "tab:red",
    "no difference shown": "tab:grey",
    "too few seeds": "lightgrey",
}


def forest_panels(panels: list[dict[str, Any]], path: Path, title: str) -> Path:
    """One panel per task, two across: a dot and its 95% interval per encoding, right of the reference line where
    TAPE is ahead, coloured by the verdict. Each panel is {"title", "x_label", "note", "ratio", "rows": [(name, mean,
    low, high, outcome in OUTCOME_COLOURS)]}: differences around 0, or with "ratio" true ratios around 1 on a log
    axis; the note (e.g. who did not learn) is written under the axis, or across it when there are no rows."""
    plt = _pyplot()
    columns = 2 if len(panels) > 1 else 1
    grid_rows = -(-len(panels) // columns)
    heights = [
        max(len(panel["rows"]) for panel in panels[r * columns : (r + 1) * columns]) * 0.22 + 1.6
        for r in range(grid_rows)
    ]
    fig, axes = plt.subplots(
        grid_rows,
        columns,
        figsize=(6.4 * columns, sum(heights) + 0.8),
        squeeze=False,
        layout="constrained",
        gridspec_kw={"height_ratios": heights},
    )
    for axis in list(axes.flat)[len(panels) :]:
        axis.axis("off")
    for axis, panel in zip(axes.flat, panels):
        rows = panel["rows"]
        axis.set_title(panel["title"], fontsize=9)
        if not rows:
            axis.text(0.5, 0.5, panel["note"], ha="center", va="center", fontsize=8, transform=axis.transAxes)
            axis.set_xticks([])
            axis.set_yticks([])
            continue
        for position, (_, mean, low, high, outcome) in enumerate(rows):
            axis.errorbar(
                mean,
                position,
                xerr=[[mean - low], [high - mean]],
                fmt="o",
                color=OUTCOME_COLOURS[outcome],
                markersize=4,
                capsize=2,
                label=outcome,
            )
        if panel.get("ratio"):
            axis.set_xscale("log")
        axis.axvline(1 if panel.get("ratio") else 0, color="black", linewidth=0.8)
        axis.set_yticks(range(len(rows)), [textwrap.fill(row[0], 18) for row in rows], fontsize=8)
        axis.set_ylim(len(rows) - 0.5, -0.5)
        note = f"\n{wrapped(panel['note'], 5.5)}" if panel.get("note") else ""
        axis.set_xlabel(panel["x_label"] + note, fontsize=8)
        axis.grid(axis="x", alpha=0.3)
    handles = {}
    for axis in axes.flat:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    ordered = [label for label in OUTCOME_COLOURS if label in handles]
    fig.legend([handles[label] for label in ordered], ordered, loc="outside lower center", ncols=4, fontsize=8)
    fig.suptitle(wrapped(title, 6.4 * columns), fontsize=10)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


__all__ = [
    "OUTCOME_COLOURS",
    "curves",
    "forest_panels",
    "heatmap",
    "heatmap_grid",
    "heatmaps",
    "learning_panels",
    "state_norm_panels",
]
