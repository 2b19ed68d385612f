"""`tapelm compare TASK --pe ... --seeds ...`: models that differ only in their positional encoding, trained with
identical budgets and evaluated on the same test data; mean ± std across seeds, a markdown table and figures.

Results are cached per (task, encoding, seed, settings hash) in ROOT/compare/TASK/HASH/PE/seedSEED (a finished run
has result.json; an unfinished one resumes from its last checkpoint), so an interrupted comparison continues where it
stopped and a later comparison with more encodings or seeds reuses what is done, and the tokenizer its first run saved
(`comparison_tokenizer`). On a machine without that cache, `archive` (the folder where `tapelm report` keeps every
comparison's result files, docs/results/compare) supplies the finished runs (`restore_archived`).
"""

from __future__ import annotations

import json
import logging
import math
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..analysis.statistics import (
    format_difference,
    higher_is_better,
    interval,
    paired_difference,
    proportion_error,
    verdict,
)
from ..training.launchers import LocalLauncher, Log
from ..variants import AT_EVALUATION, check_row, trained_row
from .claims import learned_threshold, verdict_lines
from .launchers import Job
from .reuse import evaluate_trained_elsewhere, trained_elsewhere
from .runs import (
    RESULT_FILE,
    RESULT_FILES,
    RunOptions,
    RunSpec,
    identity_differences,
    option_flags,
    recipe_lr,
    resolve,
    settings_hash,
    training_fingerprint,
)
from .scaling import check_scaled, evaluate_scaled
from .sweep import learning_curve
from .tasks import TOKENIZER_FILE

logger = logging.getLogger(__name__)

COMPARISON_FILE = "comparison.json"
DEFAULT_PES = ("tape", "rope")
TUNED_SUFFIX = "-tuned"  # the comparison at tuned rates: ROOT/compare/TASK/HASH-tuned, HASH the recipe's (shared rate)


def is_tuned(record: dict[str, Any]) -> bool:
    """Whether a comparison record is one at each encoding's tuned rate (`compare(..., rates=...)`)."""
    return "rates" in record


def comparison_dir(root: Path, task: str, settings_hash: str) -> Path:
    return Path(root) / "compare" / task / settings_hash


@dataclass
class Comparison:
    """A comparison made ready to run (`open_comparison`): its folder, its resolved runs {(pe, seed): ResolvedRun}
    and the command recorded with them."""

    directory: Path
    runs: dict[tuple[str, int], Any]
    command: str

    def run_dir(self, pe: str, seed: int) -> Path:
        return self.directory / pe / f"seed{seed}"

    def finished(self, pe: str, seed: int) -> bool:
        return (self.run_dir(pe, seed) / RESULT_FILE).exists()


def open_comparison(
    base: RunSpec,
    pes: list[str],
    seeds: list[int],
    root: str | Path = "runs",
    command: str | None = None,
    ablation: bool = False,
    compile_layers: bool = False,
    archive: str | Path | None = None,
    rates: dict[str, float] | None = None,
) -> Comparison:
    """Validate and resolve every (encoding, seed) of `base`, copy in the finished runs archived in `archive` (see
    `restore_archived`) and record the comparison in its folder; nothing is trained. ValueError before any write
    when an argument is wrong. `rates` ({pe: peak learning rate}, `tune.tuned_rates`): the comparison at each
    encoding's tuned rate, in the folder HASH-tuned beside the recipe's HASH; an encoding whose rate is the shared
    one takes its finished runs from HASH (the cache, else `archive`) instead of training them again."""
    if not pes:
        raise ValueError("give at least one encoding with --pe")
    for pe in pes:
        check_row(pe)
    bad_seeds = [s for s in seeds if not isinstance(s, int) or s < 0]
    if not seeds or bad_seeds:
        raise ValueError(f"seeds={seeds!r} is not allowed; give non-negative integers")
    if archive is not None and not Path(archive).is_dir():
        raise ValueError(
            f"--archive folder '{archive}' does not exist; give the folder `tapelm report` archives "
            "comparisons in (docs/results/compare)"
        )
    pes = list(dict.fromkeys(row for pe in pes for row in ((trained_row(pe), pe) if pe in AT_EVALUATION else (pe,))))
    seeds = list(dict.fromkeys(seeds))
    untuned = [pe for pe in pes if rates is not None and trained_row(pe) not in rates]
    if untuned:
        raise ValueError(f"no tuned rate for encoding '{untuned[0]}'; tuned: {', '.join(rates)}")
    specs = {(pe, seed): _row_spec(base, pe, seed, rates) for seed in seeds for pe in pes}
    recipe = settings_hash(RunSpec(**{**vars(base), "pe": pes[0]}))
    shared = comparison_dir(Path(root), base.task, recipe)
    directory = shared.with_name(recipe + TUNED_SUFFIX) if rates is not None else shared
    tokenizer_dir = comparison_tokenizer(directory) or (comparison_tokenizer(shared) if rates is not None else None)
    runs = {key: resolve(spec, tokenizer_dir) for key, spec in specs.items()}
    for (pe, _), run in runs.items():
        if pe in AT_EVALUATION:
            check_scaled(run, pe)
    if rates is None:
        assert {run.settings_hash for run in runs.values()} == {recipe}, "a comparison shares its settings hash"
    if archive is not None:
        restore_archived(Path(archive) / base.task / directory.name, directory, runs)
    if rates is not None:
        _check_finished(directory, runs)
        at_shared = {key: run for key, run in runs.items() if run.settings_hash == recipe}
        for source in (shared, *([Path(archive) / base.task / recipe] if archive is not None else [])):
            restore_archived(source, directory, at_shared)
    selection = ["ablate", base.task, "--variants", *pes] if ablation else ["compare", base.task, "--pe", *pes]
    # the recorded command names a relative --root only: a record holds no absolute path
    command = command or shlex.join(
        [
            "tapelm",
            *selection,
            "--seeds",
            *map(str, seeds),
            *(["--root", str(root)] if str(root) != "runs" and not Path(root).is_absolute() else []),
            *(["--tuned"] if rates is not None else []),
            *option_flags(base, compile_layers),
        ]
    )
    _record(directory, base, pes, seeds, command, runs[pes[0], seeds[0]], rates)
    return Comparison(directory, runs, command)


def _check_finished(directory: Path, runs: dict[tuple[str, int], Any]) -> None:
    """Refuse a comparison at tuned rates whose finished runs were trained otherwise (a tuning record that chose
    another rate since), before anything is written: they would be counted at the new rate."""
    for (pe, seed), run in runs.items():
        path = directory / pe / f"seed{seed}" / RESULT_FILE
        if path.is_file():
            changed = identity_differences(json.loads(path.read_text())["identity"], run)
            if changed:
                raise ValueError(
                    f"run '{path.parent}' was trained with other settings (different {', '.join(changed)}) than "
                    f"its tuned rate now gives; remove it to train it at {run.settings.lr:.4g}"
                )


def _row_spec(base: RunSpec, pe: str, seed: int, rates: dict[str, float] | None) -> RunSpec:
    """One run of a comparison: `base` with its encoding (for a row evaluated from another's models, that row's) and
    seed, and at a tuned comparison its encoding's rate."""
    spec = RunSpec(**{**vars(base), "pe": trained_row(pe), "seed": seed})
    if rates is None:
        return spec
    return RunSpec(**{**vars(spec), "train_options": {**base.train_options, "lr": rates[trained_row(pe)]}})


def compare(
    base: RunSpec,
    pes: list[str],
    seeds: list[int],
    root: str | Path = "runs",
    progress: bool = True,
    command: str | None = None,
    jobs: int = 1,
    ablation: bool = False,
    compile_layers: bool = False,
    archive: str | Path | None = None,
    launcher=None,
    data_workers: int = 0,
    report_to: tuple[str, ...] = (),
    log: Log | None = None,
    rates: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Run (or reuse) every (encoding, seed) of `base` and aggregate; returns the summary (see `aggregate`). `log`
    receives the progress lines, the table, the verdicts and the figures' paths (default: this module's logger; the
    command prints them).
    `launcher` (`launchers`; default: local, `jobs` runs at once per device, each worker with torch's current thread
    count) trains the runs still to do. `ablation` records the command as `tapelm ablate` (the encodings are TAPE's
    variants). `compile_layers`, `data_workers` (split between concurrent runs), `report_to`: see `RunOptions`.
    `archive`: reuse the finished runs archived there (see `restore_archived`). `rates`: the comparison at each
    encoding's tuned rate (see `open_comparison`)."""
    options = RunOptions(progress, compile_layers, data_workers, report_to)
    if launcher is not None and jobs != 1:
        raise ValueError(f"jobs={jobs!r} is an option of the local launcher; give LocalLauncher(jobs) as the launcher")
    launcher = launcher or LocalLauncher(jobs)
    comparison = open_comparison(base, pes, seeds, root, command, ablation, compile_layers, archive, rates)
    directory, runs, command = comparison.directory, comparison.runs, comparison.command
    say = log or logger.info
    pending, to_evaluate, elsewhere = [], [], {}
    for index, (pe, seed) in enumerate(runs, 1):
        run_dir = comparison.run_dir(pe, seed)
        state = _state(comparison, pe, seed)
        if state == "to run" and pe not in AT_EVALUATION and (source := trained_elsewhere(runs[pe, seed], run_dir)):
            elsewhere[pe, seed] = source
            state = f"trained in {source.parents[1].name}, to evaluate"
        say(f"[{index}/{len(runs)}] {base.task} / {pe} / seed {seed}: {state} ({run_dir})")
        if state != "cached" and (pe, seed) not in elsewhere:
            (to_evaluate if pe in AT_EVALUATION else pending).append((pe, seed))
    for (pe, seed), source in elsewhere.items():
        result = evaluate_trained_elsewhere(source, runs[pe, seed], comparison.run_dir(pe, seed), command)
        say(f"    {pe} / seed {seed} evaluated from the model of {source.parents[1].name}: {Job.summary(result)}")
    jobs = [Job(runs[key], comparison.run_dir(*key), command) for key in pending]
    for outcome in launcher.launch(jobs, options):
        if outcome.error is not None:
            raise outcome.error
    for pe, seed in to_evaluate:  # after the training: each evaluates a model trained above or before
        trained = comparison.run_dir(trained_row(pe), seed)
        result = evaluate_scaled(trained, runs[pe, seed], pe, comparison.run_dir(pe, seed))
        say(f"    {pe} / seed {seed} evaluated from {trained.name}: {Job.summary(result)}")
    summary = aggregate(directory)
    say(summary["table"])
    for line in verdict_lines(summary):
        say(line)
    for figure in summary["figures"]:
        say(f"figure: {directory / figure}")
    return summary


def _state(comparison: Comparison, pe: str, seed: int) -> str:
    """ "cached" for a finished run, "to run" for one to train or evaluate; for a row evaluated from another's model,
    "stale: ..." when that model was trained again since (its recorded `training_fingerprint` is not the trained
    run's: it is evaluated again; a row recorded before rows kept one counts as cached)."""
    if not comparison.finished(pe, seed):
        return "to run"
    if pe not in AT_EVALUATION:
        return "cached"
    trained = comparison.run_dir(trained_row(pe), seed) / RESULT_FILE
    recorded = json.loads((comparison.run_dir(pe, seed) / RESULT_FILE).read_text()).get("trained_fingerprint")
    if recorded and trained.is_file() and recorded != training_fingerprint(json.loads(trained.read_text())):
        return f"stale: {trained_row(pe)}'s model was trained again, to evaluate"
    return "cached"


def restore_archived(source: Path, directory: Path, runs: dict[tuple[str, int], Any]) -> list[tuple[str, int]]:
    """Copy into the comparison folder `directory` every run of `runs` ({(pe, seed): ResolvedRun}) that the cache
    lacks and the comparison folder `source` (its archive, docs/results/compare/TASK/HASH, or the same recipe's
    comparison at the shared rate) holds finished, so that the comparison continues where it stopped on another
    machine; returns the (pe, seed) restored. Refused, before anything is copied, when a run there was trained
    with other settings or on other data (`Task.data_record`), or when runs remain to train on a tokenizer that the
    archive does not keep."""
    source = Path(source)
    found = {}
    for (pe, seed), run in runs.items():
        archived, cached = source / pe / f"seed{seed}", directory / pe / f"seed{seed}"
        if (cached / RESULT_FILE).exists() or not (archived / RESULT_FILE).exists():
            continue
        try:
            saved = json.loads((archived / RESULT_FILE).read_text())
            identity = saved["identity"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(
                f"archived run '{archived}' has an unreadable {RESULT_FILE}; remove it from the "
                "archive or leave out --archive"
            ) from None
        changed = identity_differences(identity, run)
        if changed:
            raise ValueError(
                f"archived run '{archived}' was trained with other settings (different "
                f"{', '.join(changed)}); remove it from the archive or leave out --archive"
            )
        if saved.get("data", {}) not in ({}, run.task.data_record()):
            raise ValueError(
                f"archived run '{archived}' was trained on other data ({saved['data']}, here "
                f"{run.task.data_record()}); remove it from the archive or leave out --archive"
            )
        found[pe, seed] = (archived, cached)
    remaining = [
        run
        for key, run in runs.items()
        if key not in found and not (directory / key[0] / f"seed{key[1]}" / RESULT_FILE).exists()
    ]
    if (
        found
        and any(type(run.task).tokenizer_is_trained(run.task_options) for run in remaining)
        and comparison_tokenizer(directory) is None
    ):
        raise ValueError(
            f"the archive keeps no tokenizer, and the runs still to train in '{directory}' would train "
            "their own; run the whole comparison again, without --archive"
        )
    for archived, cached in found.values():
        for name in sorted(RESULT_FILES, key=lambda n: n == RESULT_FILE):  # result.json last: it marks a run done
            if (archived / name).exists():
                copy_atomically(archived / name, cached / name)
    return list(found)


def copy_atomically(source: Path, target: Path) -> None:
    """Copy through a temporary file and a rename (creating the target's folder): readers never see half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(target.name + ".tmp")
    shutil.copyfile(source, temporary)
    temporary.replace(target)


def comparison_tokenizer(directory: Path) -> Path | None:
    """A run folder of the comparison that saved its tokenizer: every run of a comparison uses the one the first
    run trained (a BPE trained again, e.g. on another machine's corpus, could give other token ids); None before."""
    return next((path.parent for path in sorted(Path(directory).glob(f"*/seed*/{TOKENIZER_FILE}"))), None)


def requested_runs(record: dict[str, Any]) -> dict[str, list[int]]:
    """{pe: seeds} the comparison's commands asked for (a record written before these were kept: every seed of every
    encoding)."""
    return record.get("runs") or {pe: list(record["seeds"]) for pe in record["pes"]}


def merge_records(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`new`'s settings, with the union of both records' runs asked for and commands; the encodings and seeds are
    those of the runs."""
    runs = requested_runs(old) if old else {}
    for pe, seeds in requested_runs(new).items():
        runs[pe] = sorted(set(runs.get(pe, [])) | set(seeds))
    merged = {
        **new,
        "runs": runs,
        "pes": list(runs),
        "seeds": sorted({s for seeds in runs.values() for s in seeds}),
        "commands": list(dict.fromkeys([*old.get("commands", []), *new["commands"]])),
    }
    if is_tuned(old) or is_tuned(new):
        merged["rates"] = {**old.get("rates", {}), **new.get("rates", {})}
    return merged


def _record(
    directory: Path, base: RunSpec, pes: list[str], seeds: list[int], command: str, run, rates: dict[str, float] | None
) -> None:
    """comparison.json: the shared settings, every command that added to this comparison and the runs it asked for;
    at tuned rates, each encoding's rate ("rates") beside the recipe's ("train", with its shared "lr")."""
    path = directory / COMPARISON_FILE
    new = {
        "commands": [command],
        "runs": {pe: sorted(seeds) for pe in pes},
        "task": base.task,
        "preset": base.preset,
        "settings_hash": run.settings_hash,
        "task_options": run.identity["task_options"],
        "train": {k: v for k, v in run.identity["train"].items() if k != "seed"},  # shared: seeds are in "runs"
        "eval": run.identity["eval"],
        "match_params": base.match_params,
        "model_options": base.model_options,
    }
    if rates is not None:
        new["settings_hash"] = directory.name
        new["train"]["lr"] = recipe_lr(base)
        new["rates"] = {pe: rates[pe] for pe in pes}
    record = merge_records(json.loads(path.read_text()) if path.exists() else {}, new)
    directory.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(record, indent=1))
    temporary.replace(path)


def _summary_stats(summaries: list[dict[str, Any]], lengths: list[str]) -> dict[str, Any]:
    return {
        "all": interval([s["all"] for s in summaries]),
        "in_distribution": interval([s["in_distribution"] for s in summaries]),
        "longer": interval([s["longer"] for s in summaries]),
        "by_length": {x: interval([s["by_length"][x] for s in summaries]) for x in lengths},
    }


HEADLINES = ("in_distribution", "longer", "all")
REFERENCE = "tape"  # paired differences are TAPE minus each baseline


def _headline(result: dict[str, Any], key: str, metric: str) -> float:
    """One run's headline number; perplexities in log space, so that differences are log-ratios."""
    value = result["summary"][key]
    return math.log(value) if metric == "perplexity" else value


def per_seed_headlines(by_seed: dict[int, dict[str, Any]], metric: str) -> dict[str, dict[int, float]]:
    """{headline: {seed: value}} of one encoding's runs (log perplexities), the input of every paired difference."""
    return {key: {seed: _headline(result, key, metric) for seed, result in by_seed.items()} for key in HEADLINES}


def paired_differences(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """{baseline: {headline: interval of TAPE minus baseline over shared seeds}} (log-ratios for perplexity)."""
    if REFERENCE not in rows:
        return {}
    tape = rows[REFERENCE]["per_seed"]
    return {
        pe: {key: paired_difference(tape[key], row["per_seed"][key]) for key in HEADLINES}
        for pe, row in rows.items()
        if pe != REFERENCE
    }


def evaluation_error(summary: dict[str, Any], key: str, metric: str) -> float:
    """The sampling error of one run's headline accuracy from its test-set size (nan for perplexity, or for results
    written before test-set sizes were recorded)."""
    examples = summary.get("examples", {}).get(key, 0)
    return float("nan") if metric == "perplexity" else proportion_error(summary[key], examples)


def load_results(directory: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """{pe: {seed: result + its evaluation}} of the finished runs in a comparison folder."""
    found: dict[str, dict[int, dict[str, Any]]] = {}
    for path in sorted(Path(directory).glob(f"*/seed*/{RESULT_FILE}")):
        result = json.loads(path.read_text())
        result["evaluation"] = json.loads((path.parent / "eval.json").read_text())
        found.setdefault(result["pe"], {})[result["seed"]] = result
    return found


def aggregate(directory: Path, write: bool = True, only: list[str] | None = None) -> dict[str, Any]:
    """Mean ± std across seeds per encoding, from the cached results; writes summary.json, table.md and figures
    into the comparison folder (when `write`). `only` restricts the rows to those encodings or variants."""
    directory = Path(directory)
    record = json.loads((directory / COMPARISON_FILE).read_text())
    results = load_results(directory)
    if only is not None:
        results = {pe: by_seed for pe, by_seed in results.items() if pe in only}
        record = {**record, "pes": [pe for pe in record["pes"] if pe in only]}
    order = [pe for pe in record["pes"] if pe in results] + sorted(set(results) - set(record["pes"]))
    order.sort(key=lambda pe: pe != REFERENCE)  # TAPE's row first: the paired table is read against it
    rows = {}
    for pe in order:
        by_seed = results[pe]
        first = next(iter(by_seed.values()))
        lengths = list(first["summary"]["by_length"])
        rows[pe] = {
            "seeds": sorted(by_seed),
            "parameters": first["parameters"],
            "per_seed": per_seed_headlines(by_seed, first["metric"]),
            **_summary_stats([r["summary"] for r in by_seed.values()], lengths),
            "evaluation_error": {
                key: interval([evaluation_error(r["summary"], key, r["metric"]) for r in by_seed.values()])["mean"]
                for key in HEADLINES
            },
            "final_loss": interval([r["final_loss"] for r in by_seed.values()]),
            "seconds": interval([r.get("session_seconds") for r in by_seed.values()]),
        }
        if all(r.get("token_accuracy_summary") for r in by_seed.values()):
            rows[pe]["token_accuracy"] = _summary_stats(
                [r["token_accuracy_summary"] for r in by_seed.values()], lengths
            )
    any_result = next((r for by_seed in results.values() for r in by_seed.values()), None)
    metric = any_result["metric"] if any_result else "?"
    evaluation = any_result["evaluation"] if any_result else None
    summary = {
        "task": record["task"],
        "settings_hash": record["settings_hash"],
        "metric": metric,
        "record": record,
        "rows": rows,
        "figures": [],
        "x_label": evaluation["x_label"] if evaluation else "",
        "training_edge": evaluation["training_edge"] if evaluation else None,
        "missing": [
            f"{pe}/seed{s}"
            for pe, seeds in requested_runs(record).items()
            if pe in record["pes"]
            for s in seeds
            if s not in results.get(pe, {})
        ],
        "paired": paired_differences(rows),
        "state_norms": mean_state_norms(directory, rows),
        "learning_curves": learning_curves(directory, rows),
    }
    summary["table"] = format_table(summary)
    if write and results:
        summary["figures"] = write_figures(summary, results, directory)
        (directory / "table.md").write_text(summary["table"] + "\n")
        (directory / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _format(stats: dict[str, float], metric: str) -> str:
    """mean ± the 95% confidence half-width across seeds (the mean alone for one seed)."""
    if stats["n"] == 0:
        return "–"
    scale, digits = (1, 3) if metric == "perplexity" else (100, 1)
    mean = f"{stats['mean'] * scale:.{digits}f}"
    return f"{mean} ± {stats['half_width'] * scale:.{digits}f}" if stats["n"] > 1 else mean


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
    errors = (
        metric != "perplexity" and rows and all(not math.isnan(row["evaluation_error"]["all"]) for row in rows.values())
    )
    if errors:
        header += ["test-set s.e. all (%)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 2 + "---:|" * (len(header) - 2)]
    for pe, row in rows.items():
        cells = [
            pe,
            f"{row['parameters'] / 1e6:.3f}M",
            ",".join(map(str, row["seeds"])),
            _format(row["in_distribution"], metric),
            _format(row["longer"], metric),
            _format(row["all"], metric),
        ]
        if per_length:
            cells += [_format(row["by_length"][x], metric) for x in lengths]
        if tokens:
            cells += [
                _format(row["token_accuracy"]["in_distribution"], "accuracy"),
                _format(row["token_accuracy"]["longer"], "accuracy"),
            ]
        loss = row["final_loss"]
        cells.append(f"{loss['mean']:.3f}" if loss["n"] else "–")
        if errors:
            cells.append(f"{row['evaluation_error']['all'] * 100:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    direction = "higher" if higher_is_better(metric) else "lower"
    lines.append("")
    lines.append(
        f"{metric.replace('_', ' ')}, {direction} is better; mean ± half-width of the 95% confidence "
        "interval across seeds (t distribution)."
        + (
            " Token accuracy: the share of answer tokens predicted right (teacher-forced), from the same logits."
            if tokens
            else ""
        )
        + (
            " Test-set s.e.: the binomial standard error of one run's 'all' from its number of test "
            "examples, to set beside the spread across seeds."
            if errors
            else ""
        )
    )
    if summary.get("paired"):
        lines += ["", format_paired(summary)]
    return "\n".join(lines)


def format_paired(summary: dict[str, Any]) -> str:
    """Markdown: TAPE minus each baseline, paired by seed, with 95% intervals and what they show."""
    metric = summary["metric"]
    higher = higher_is_better(metric)
    log = metric == "perplexity"
    header = ["TAPE divided by" if log else "TAPE minus", "seeds"] + [f"{key.replace('_', '-')}" for key in HEADLINES]
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * len(HEADLINES)]
    for pe, differences in summary["paired"].items():
        cells = [pe, ",".join(map(str, differences["all"]["seeds"]))]
        for key in HEADLINES:
            d = differences[key]
            if d["n"] == 0:
                cells.append("–")
                continue
            text = format_difference(d, log)
            cells.append(f"{text} ({verdict(d, higher)})")
        lines.append("| " + " | ".join(cells) + " |")
    unit = (
        "perplexity ratio TAPE / baseline with its 95% interval"
        if log
        else "difference in points, ± half-width of the 95% interval"
    )
    return "\n".join(
        lines
        + [
            "",
            f"Paired by seed (same training data stream and test set): {unit}; 'better' / "
            f"'worse' when the interval excludes {'1' if log else 'zero'}.",
        ]
    )


def state_norm_history(run_dir: Path) -> tuple[list[int], np.ndarray] | None:
    """(steps, norms (steps, layers + 1)) of the positional state recorded by a run's in-training evaluations."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    found = [(r["step"], r["eval"]["state_norm"]) for r in records if "state_norm" in r.get("eval", {})]
    return ([step for step, _ in found], np.array([norms for _, norms in found])) if found else None


def mean_state_norms(directory: Path, rows: dict[str, Any]) -> dict[str, dict[str, list]]:
    """Per row with a recorded positional state: {"steps", "norms" (steps x (layers + 1))}, the mean over seeds of
    its norm history."""
    found = {}
    for pe, row in rows.items():
        histories = [h for seed in row["seeds"] if (h := state_norm_history(directory / pe / f"seed{seed}"))]
        if histories and len({len(steps) for steps, _ in histories}) == 1:
            found[pe] = {"steps": histories[0][0], "norms": np.mean([norms for _, norms in histories], axis=0).tolist()}
    return found


def learning_curves(directory: Path, rows: dict[str, Any]) -> dict[str, dict[str, list]]:
    """Per row: {seed: [[step, in-distribution metric], ...]} from each run's in-training quick evaluations, so that
    whether and when a run learned can be read beside its result."""
    found = {}
    for pe, row in rows.items():
        runs = {str(seed): directory / pe / f"seed{seed}" for seed in row["seeds"]}
        curves = {
            seed: [list(point) for point in learning_curve(path)["in_distribution"]]
            for seed, path in runs.items()
            if (path / "metrics.jsonl").exists()
        }
        if any(curves.values()):
            found[pe] = {seed: points for seed, points in curves.items() if points}
    return found


def write_figures(
    summary: dict[str, Any], results: dict[str, dict[int, dict[str, Any]]], directory: Path, prefix: str = ""
) -> list[str]:
    """Heatmaps (addition), the metric-against-length curves, the learning curves (`summary["learning_curves"]`, with
    the bar at which a run counts as learned) and, for variants with a positional state, its norm over training
    (`summary["state_norms"]`); returns the file names written."""
    from ..analysis.plots import curves, heatmap_grid, heatmaps, learning_panels, state_norm_panels

    task, metric = summary["task"], summary["metric"]
    names = []
    tokens = all("token_accuracy" in row for row in summary["rows"].values())
    if task == "addition":
        variants = [("value", "exact match", "")] + (
            [("token_accuracy", "token accuracy", "-tokens")] if tokens else []
        )
        for field, label, suffix in variants:
            grids = {}
            for pe in summary["rows"]:
                cells = [
                    [{**c, "value": c[field]} for c in r["evaluation"]["conditions"]] for r in results[pe].values()
                ]
                grids[pe] = np.mean([heatmap_grid(c) for c in cells], axis=0)
            name = f"{prefix}{task}-heatmaps{suffix}.png"
            heatmaps(
                grids,
                directory / name,
                f"{task}: {label} per operand-length cell (mean over seeds; dashed: training range)",
                edge=summary["training_edge"],
                label=label,
            )
            names.append(name)
    variants = [(lambda row: row, metric, "")]
    if tokens:
        variants.append((lambda row: row["token_accuracy"], "token_accuracy", "-tokens"))
    for pick, label, suffix in variants:
        series = {}
        for pe, row in summary["rows"].items():
            by_length = pick(row)["by_length"]
            series[pe] = (
                [float(x) for x in by_length],
                [s["mean"] for s in by_length.values()],
                [s["std"] for s in by_length.values()],
            )
        name = f"{prefix}{task}-by-length{suffix}.png"
        curves(
            series,
            directory / name,
            f"{task}: {label.replace('_', ' ')} against length (mean ± std over seeds)",
            summary["x_label"],
            label,
            edge=summary["training_edge"],
        )
        names.append(name)
    if summary.get("learning_curves"):
        name = f"{prefix}{task}-learning.png"
        label = metric.replace("_", " ")
        learning_panels(
            summary["learning_curves"],
            directory / name,
            f"{task}: in-distribution {label} over "
            "training, a line per seed (quick evaluations; dashed: the bar at which a run counts as "
            "learned)",
            metric,
            bar=learned_threshold(task),
        )
        names.append(name)
    panels = {pe: (found["steps"], np.array(found["norms"])) for pe, found in summary["state_norms"].items()}
    if panels:
        name = f"{prefix}{task}-state-norm.png"
        state_norm_panels(
            panels,
            directory / name,
            f"{task}: norm of TAPE's positional state E per layer over training (mean over seeds)",
        )
        names.append(name)
    return names


__all__ = [
    "Comparison",
    "compare",
    "open_comparison",
    "restore_archived",
    "copy_atomically",
    "aggregate",
    "format_table",
    "load_results",
    "comparison_dir",
    "learning_curves",
    "mean_state_norms",
    "write_figures",
]
