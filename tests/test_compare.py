"""`tapelm compare` caching and aggregation, and `tapelm report` built from the cache."""

from __future__ import annotations

import json
import math
import shutil
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import TINY_ADDITION as TINY
from tapelm.cli import main
from tapelm.experiments.claims import CLAIMS, judge
from tapelm.experiments.compare import (
    aggregate,
    compare,
    format_table,
    load_results,
    merge_records,
    paired_differences,
    requested_runs,
)
from tapelm.experiments.plan import OWED, default_settings_hash, superseded_by
from tapelm.experiments.runs import RunSpec, settings_hash
from tapelm.positional import encoding_names
from tapelm.report import README_SECTIONS, build_report, readme_sections, splice
from tapelm.report.cost_section import medians, run_seconds
from tapelm.report.findings_section import best_other, findings_row, findings_table
from tapelm.report.glance_section import FIGURE, panel, table


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    assert main(["compare", "addition", "--pe", "tape", "rope", "--seeds", "0", "1", "--root", str(root), *TINY]) == 0
    return root


def comparison(root: Path) -> Path:
    (directory,) = list((root / "compare" / "addition").iterdir())
    return directory


def test_compare_caches_each_encoding_and_seed(compared, capsys) -> None:
    directory = comparison(compared)
    results = sorted(p.relative_to(directory).as_posix() for p in directory.glob("*/seed*/result.json"))
    assert results == [
        "rope/seed0/result.json",
        "rope/seed1/result.json",
        "tape/seed0/result.json",
        "tape/seed1/result.json",
    ]
    stamps = {p: p.stat().st_mtime_ns for p in directory.glob("*/seed*/result.json")}
    capsys.readouterr()
    # Rerunning, and adding an encoding, trains only what is missing.
    assert (
        main(["compare", "addition", "--pe", "tape", "rope", "nope", "--seeds", "0", "--root", str(compared), *TINY])
        == 0
    )
    printed = capsys.readouterr().out
    assert printed.count("cached") == 2 and "nope / seed 0: to run" in printed
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    record = json.loads((directory / "comparison.json").read_text())
    assert record["pes"] == ["tape", "rope", "nope"] and record["seeds"] == [0, 1] and len(record["commands"]) == 2
    assert record["runs"] == {"tape": [0, 1], "rope": [0, 1], "nope": [0]}
    assert not any(str(compared) in command for command in record["commands"])  # no absolute path in a record
    assert "seed" not in record["train"]  # the shared settings; each run's seed is in "runs"
    assert all((directory / f"addition-{name}.png").is_file() for name in ("heatmaps", "by-length", "learning"))
    assert "| tape |" in printed and "figure:" in printed


def test_mean_and_std_across_seeds(compared, tmp_path) -> None:
    summary = aggregate(comparison(compared), write=False)
    tape = summary["rows"]["tape"]
    values = []
    for seed in (0, 1):
        result = json.loads((comparison(compared) / "tape" / f"seed{seed}" / "result.json").read_text())
        values.append(result["summary"]["all"])
    assert tape["all"]["mean"] == pytest.approx(sum(values) / 2)
    assert tape["all"]["std"] == pytest.approx(abs(values[0] - values[1]) / 2**0.5)
    assert tape["seeds"] == [0, 1] and summary["rows"]["nope"]["seeds"] == [0]
    # The learning curves are each run's in-training quick evaluations, in order.
    for pe, seeds in (("tape", (0, 1)), ("nope", (0,))):
        for seed in seeds:
            lines = (comparison(compared) / pe / f"seed{seed}" / "metrics.jsonl").read_text().splitlines()
            evaluations = [
                [r["step"], r["eval"]["in_distribution_exact_match"]] for r in map(json.loads, lines) if "eval" in r
            ]
            assert [step for step, _ in evaluations] == [3, 6]
            assert summary["learning_curves"][pe][str(seed)] == evaluations
    assert summary["missing"] == []  # nope was asked for seed 0 only
    unfinished = shutil.copytree(comparison(compared), tmp_path / "unfinished")
    (unfinished / "tape" / "seed1" / "result.json").unlink()
    assert aggregate(unfinished, write=False)["missing"] == ["tape/seed1"]


def test_merged_records_keep_the_runs_each_command_asked_for() -> None:
    legacy = {"pes": ["tape", "rope"], "seeds": [0, 1], "commands": ["a"]}  # written before "runs" was kept
    new = {"commands": ["b"], "runs": {"nope": [2]}, "task": "addition"}
    merged = merge_records(legacy, new)
    assert merged["runs"] == {"tape": [0, 1], "rope": [0, 1], "nope": [2]} and requested_runs(merged) == merged["runs"]
    assert merged["pes"] == ["tape", "rope", "nope"] and merged["seeds"] == [0, 1, 2]
    assert merged["commands"] == ["a", "b"] and merged["task"] == "addition"
    assert merge_records(merged, {**new, "commands": ["a"]}) == merged


def stat(mean: float, half_width: float, n: int = 2) -> dict[str, float]:
    return {"mean": mean, "std": 0.0, "n": n, "half_width": half_width}


def test_format_table_on_hand_made_numbers() -> None:
    row = {
        "seeds": [0, 1],
        "parameters": 1_234_000,
        "all": stat(0.5, 0.1),
        "in_distribution": stat(0.9, 0.05),
        "longer": stat(0.25, 0.0),
        "by_length": {"1": stat(1.0, 0.0)},
        "final_loss": stat(0.1234, 0.0),
        "evaluation_error": {"all": 0.0125, "in_distribution": 0.01, "longer": 0.02},
    }
    difference = {"mean": 0.03, "half_width": 0.01, "n": 2, "std": 0.0, "seeds": [0, 1]}
    summary = {
        "task": "addition",
        "metric": "exact_match",
        "rows": {"tape": row, "rope": row},
        "paired": {
            "rope": {
                "in_distribution": difference,
                "longer": {**difference, "half_width": 0.05},
                "all": {**difference, "mean": -0.03},
            }
        },
    }
    table = format_table(summary)
    assert "| tape | 1.234M | 0,1 | 90.0 ± 5.0 | 25.0 ± 0.0 | 50.0 ± 10.0 | 0.123 | 1.25 |" in table
    assert "| rope | 0,1 | +3.0 ± 1.0 (better) | +3.0 ± 5.0 (no difference shown) | -3.0 ± 1.0 (worse) |" in table


def test_report_is_built_from_the_cache_and_keeps_foreign_text(compared, tmp_path) -> None:
    out = tmp_path / "docs" / "RESULTS.md"
    out.parent.mkdir()
    out.write_text("# Results\n\nIntro by a person.\n\n## Fine-tuning\n\nWritten by another tool.\n")
    assert sorted(build_report(compared, out)) == ["claims", "coverage", "cpu-cost", "findings", "task-comparison"]
    text = out.read_text()
    assert "tape did not learn addition in distribution" in text and "| **inconclusive** |" in text
    assert f"; not the preset's current recipe, `{default_settings_hash('addition')}`" in text  # TINY's settings
    assert "Intro by a person." in text and "Written by another tool." in text
    assert "<!-- tapelm-report:begin task-comparison -->" in text
    assert "tapelm compare addition --pe tape rope --seeds 0 1" in text and "| tape |" in text
    figures = sorted(p.name for p in (tmp_path / "docs" / "figures").iterdir())
    assert any(name.endswith("addition-heatmaps.png") for name in figures)
    assert all(f"figures/{name}" in text for name in figures if name.endswith(".png"))
    first = text
    # idempotent: each section is replaced, not added
    assert sorted(build_report(compared, out)) == ["claims", "coverage", "cpu-cost", "findings", "task-comparison"]
    assert out.read_text() == first


README_MARKERS = "<!-- tapelm-report:begin at-a-glance -->\nold table\n<!-- tapelm-report:end at-a-glance -->\n"


def test_report_writes_the_readme_first_screen_only_between_its_markers(compared, tmp_path) -> None:
    out = tmp_path / "docs" / "RESULTS.md"
    readme = tmp_path / "README.md"
    readme.write_text("# tool\n\nFront page.\n")
    assert not any(name.startswith(f"{readme}:") for name in build_report(compared, out, readme=readme))
    assert readme.read_text() == "# tool\n\nFront page.\n"  # no markers: the file is not touched
    readme.write_text(f"# tool\n\n{README_MARKERS}\nAfter.\n")
    written = build_report(compared, out, readme=readme)
    assert f"{readme}:at-a-glance" in written
    text = readme.read_text()
    assert "old" not in text and text.startswith("# tool\n\n<!-- tapelm-report:begin at-a-glance -->\n")
    assert text.endswith("\n<!-- tapelm-report:end at-a-glance -->\n\nAfter.\n")
    assert "](docs/figures/tape-against-each.png)" in text and (tmp_path / "docs" / "figures" / FIGURE).is_file()
    hash_ = comparison(compared).name
    # TINY's comparison, the only one archived: TAPE did not learn it, so the claim cannot be judged
    assert f"| addition (6 steps, `{hash_}`) | " in text and text.count("| **inconclusive** |") == 1
    findings = out.read_text().split("<!-- tapelm-report:begin findings -->")[1]
    assert "| **inconclusive** on the average over every length: TAPE did not learn the task |" in findings
    assert build_report(compared, out, readme=readme) == written and readme.read_text() == text  # idempotent


def test_report_refuses_a_readme_that_lost_one_tables_markers(compared, tmp_path, capsys, monkeypatch) -> None:
    """A README with some of the report's markers but not all (here with a second section a user registered), or a
    begin marker without its end, is refused in one line before anything is written, so that no table silently
    stops being rewritten."""
    monkeypatch.setitem(README_SECTIONS, "extra", lambda context: "extra")
    out = tmp_path / "docs" / "RESULTS.md"
    readme = tmp_path / "README.md"
    with_extra = README_MARKERS + "<!-- tapelm-report:begin extra -->\n<!-- tapelm-report:end extra -->\n"
    for broken, named in ((README_MARKERS, "extra"), (with_extra.replace("end at-a-glance", "end"), "at-a-glance")):
        readme.write_text(broken)
        capsys.readouterr()
        assert main(["report", "--root", str(compared), "--out", str(out), "--readme", str(readme)]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and error.startswith(f"tapelm: error: {readme}") and named in error
        assert readme.read_text() == broken and not out.exists()
    assert sorted(readme_sections(with_extra, "README.md")) == ["at-a-glance", "extra"]
    assert readme_sections("# another tool\n", "README.md") == []


MQAR = {  # {pe: (in-distribution mean, {seed: beyond the training length})}
    "tape": (1.0, {0: 0.90, 1: 0.92, 2: 0.94}),
    "rope": (1.0, {0: 0.60, 1: 0.70, 2: 0.65}),
    "fox": (1.0, {0: 0.99, 1: 0.98, 2: 0.99}),
    "fire": (0.99, {0: 0.95, 1: 0.96, 2: 0.97}),
    "nope": (0.50, {0: 1.0, 1: 1.0, 2: 1.0}),  # best beyond, but never learned the task: not the best
    "wall": (1.0, {0: 1.0}),  # best beyond and learned, but one seed: no interval, so not the best
}


def synthetic(task: str, metric: str, per_seed: dict[str, tuple[float, dict[int, float]]]) -> dict:
    """A comparison summary as `aggregate` makes it, from {pe: (in-distribution mean, {seed: longer})}."""
    rows = {}
    for pe, (in_distribution, longer) in per_seed.items():
        values = list(longer.values())
        mean = math.exp(sum(values) / len(values)) if metric == "perplexity" else sum(values) / len(values)
        rows[pe] = {
            "seeds": sorted(longer),
            "in_distribution": {"mean": in_distribution},
            "longer": {"mean": mean},
            "per_seed": {key: longer for key in ("longer", "all")}
            | {"in_distribution": dict.fromkeys(longer, in_distribution)},
        }
    record = {"preset": "cpu-small", "train": {"steps": 2000}, "task_options": {}}
    summary = {"task": task, "metric": metric, "settings_hash": "0123456789", "record": record, "rows": rows}
    return {**summary, "paired": paired_differences(rows)}


def test_findings_row_from_a_synthetic_comparison() -> None:
    """TAPE − RoPE and TAPE − the best encoding that learned the task, paired by seed with 95% intervals (checked by
    hand: t(0.975, 2) = 4.303), who is ahead of TAPE, and the claim's verdict with the baselines that decide it."""
    mqar = synthetic("mqar", "accuracy", MQAR)
    claim = next(c for c in CLAIMS if c.name == "retrieval-mqar")
    result, _ = judge(claim, mqar)
    assert best_other(mqar) == "fox" and result == "refuted"
    table = findings_table([(mqar, claim, result)])
    row = table.splitlines()[-1]
    assert row == (
        "| MQAR (2,000 steps, `0123456789`) | 92.0% accuracy (3 seeds) | +27.0 ± 10.8 pts (3 seeds): better "
        "| FoX -6.7 ± 5.2 pts (3 seeds): worse | ahead of TAPE: FoX, FIRE; behind: RoPE; did not learn: NoPE; "
        "too few seeds: Wall "
        "| **refuted**: FIRE ahead of TAPE; NoPE did not learn (against RoPE, RandPE, NoPE, FIRE, ALiBi) |"
    )
    text = synthetic(
        "text",
        "perplexity",
        {
            "tape": (3.3, {0: math.log(20), 1: math.log(22)}),
            "rope": (3.4, {0: math.log(4), 1: math.log(4.2)}),
            "alibi": (3.5, {0: math.log(30), 1: math.log(25)}),
        },
    )
    row = findings_table([(text, None, None)]).splitlines()[-1]
    assert "| ×5.118 [3.808, 6.877] (2 seeds): worse | RoPE ×5.118 [3.808, 6.877] (2 seeds): worse |" in row
    assert "| ahead of TAPE: RoPE; no difference shown: ALiBi | the paper makes none |" in row
    unlearned = synthetic("mqar", "accuracy", {"tape": (0.5, {0: 0.1, 1: 0.2}), "rope": (1.0, {0: 0.5, 1: 0.6})})
    row = findings_row(unlearned, claim, judge(claim, unlearned)[0])
    assert "(2 seeds): worse; TAPE did not learn it in distribution |" in row
    assert "| TAPE did not learn the task (50.0% < 95% in distribution); learned: RoPE |" in row
    assert row.endswith("| **inconclusive**: TAPE did not learn the task |")
    one_seed = synthetic("flipflop", "accuracy", {"tape": (1.0, {0: 0.9}), "rope": (1.0, {0: 0.5})})
    row = findings_row(one_seed)
    assert "| 90.0% accuracy (1 seed) | +40.0 pts (1 seed): too few seeds |" in row
    assert "| no other that learned the task shares two seeds with TAPE |" in row


def test_first_screen_panel_and_table_from_a_synthetic_comparison() -> None:
    """The README's figure puts TAPE ahead to the right for every metric (for perplexity, the other's over TAPE's on
    a log axis), orders the encodings best for TAPE first, leaves out those that did not learn (named in the
    note), and the short table agrees with the findings' cells."""
    mqar = synthetic("mqar", "accuracy", MQAR)
    shown = panel(mqar)
    assert [(row[0], row[4]) for row in shown["rows"]] == [
        ("RoPE", "TAPE ahead"),
        ("FIRE", "TAPE behind"),
        ("FoX", "TAPE behind"),
        ("Wall", "too few seeds"),
    ]
    name, mean, low, high, _ = shown["rows"][0]
    assert mean == pytest.approx(27.0) and high - mean == pytest.approx(mean - low) and mean - low > 0
    assert shown["note"] == "did not learn in distribution: NoPE"
    text = synthetic(
        "text",
        "perplexity",
        {"tape": (3.3, {0: math.log(20), 1: math.log(22)}), "rope": (3.4, {0: math.log(40), 1: math.log(33)})},
    )
    (row,) = panel(text)["rows"]  # RoPE's perplexity is x2 and x1.5 TAPE's: their geometric mean, around 1
    assert row[1] == pytest.approx(math.sqrt(2 * 1.5)) and row[2] < 1 < row[1] < row[3] and panel(text)["ratio"]
    assert row[4] == "no difference shown"
    claim = next(c for c in CLAIMS if c.name == "retrieval-mqar")
    line = table([(mqar, claim, judge(claim, mqar)[0]), (text, None, None)]).splitlines()
    assert line[2] == (
        "| MQAR (2,000 steps, `0123456789`) | +27.0 ± 10.8 pts (3 seeds): better | FoX -6.7 ± 5.2 pts (3 seeds): "
        "worse | **refuted** |"
    )
    difference = "×0.577 [0.093, 3.591] (2 seeds): no difference shown"  # t(0.975, 1) = 12.706
    assert line[3] == f"| text (2,000 steps, `0123456789`) | {difference} | RoPE {difference} | none made |"
    unlearned = synthetic("mqar", "accuracy", {"tape": (0.5, {0: 0.1, 1: 0.2}), "rope": (1.0, {0: 0.5, 1: 0.6})})
    assert panel(unlearned)["rows"] == [] and "TAPE did not learn" in panel(unlearned)["note"]


def test_cpu_cost_is_read_from_the_runs_own_seconds(compared, tmp_path) -> None:
    """Runs per CPU-hour are 3,600 over the median of each row's runs (training over every session plus the
    evaluation), and × RoPE is that median over RoPE's in the same comparison."""
    out = tmp_path / "docs" / "RESULTS.md"
    build_report(compared, out)
    section = out.read_text().split("<!-- tapelm-report:begin cpu-cost -->")[1]
    results = load_results(comparison(compared))
    seconds = {row: statistics.median(map(run_seconds, by_seed.values())) for row, by_seed in results.items()}
    assert medians(results) == seconds and all(value > 0 for value in seconds.values())
    assert f"| RoPE | {3600 / seconds['rope']:.1f} (×1.00) |" in section
    assert f"| TAPE | {3600 / seconds['tape']:.1f} (×{seconds['tape'] / seconds['rope']:.2f}) |" in section
    resumed = {"train_seconds_this_session": 1.0, "train_seconds_before_this_session": 2.0, "eval_seconds": 0.5}
    assert run_seconds(resumed) == 3.5


def test_report_outlives_the_runs_cache(compared, tmp_path) -> None:
    """The report archives each comparison's small files next to itself; without the cache it rebuilds the same
    text from the archive, and a later cache with other seeds is merged into it, not swapped for it."""
    out = tmp_path / "docs" / "RESULTS.md"
    build_report(compared, out)
    first = out.read_text()
    archived = tmp_path / "docs" / "results" / "compare" / "addition" / comparison(compared).name
    runs = sorted(
        p.parent.relative_to(comparison(compared)).as_posix() for p in comparison(compared).glob("*/seed*/result.json")
    )
    assert {"rope/seed0", "rope/seed1", "tape/seed0", "tape/seed1"} <= set(runs)
    assert sorted(p.relative_to(archived).as_posix() for p in archived.rglob("*.json*")) == [
        "comparison.json",
        *[f"{run}/{f}" for run in runs for f in ("eval.json", "metrics.jsonl", "result.json")],
    ]
    assert not list(archived.rglob("*.safetensors"))
    elsewhere = tmp_path / "other-machine"
    (elsewhere / "compare").mkdir(parents=True)
    assert sorted(build_report(elsewhere, out)) == ["claims", "coverage", "cpu-cost", "findings", "task-comparison"]
    assert out.read_text() == first
    partial = elsewhere / "compare" / "addition" / archived.name
    shutil.copytree(comparison(compared), partial)
    shutil.rmtree(partial / "tape" / "seed1")
    record = json.loads((partial / "comparison.json").read_text())
    (partial / "comparison.json").write_text(json.dumps({**record, "seeds": [0], "commands": record["commands"][:1]}))
    build_report(elsewhere, out)
    assert out.read_text() == first
    assert json.loads((archived / "comparison.json").read_text())["seeds"] == [0, 1]


def test_a_comparison_continues_from_the_archive_on_another_machine(compared, tmp_path, capsys) -> None:
    """`--archive` counts the archived runs as done (their files copied, nothing trained again) and trains only what
    is missing; an archived run of other settings is refused by name before anything is copied."""
    build_report(compared, tmp_path / "docs" / "RESULTS.md")
    archive = tmp_path / "docs" / "results" / "compare"
    elsewhere = tmp_path / "other-machine"
    capsys.readouterr()
    assert (
        main(
            [
                "compare",
                "addition",
                "--pe",
                "tape",
                "rope",
                "--seeds",
                "0",
                "1",
                "2",
                "--root",
                str(elsewhere),
                "--archive",
                str(archive),
                *TINY,
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert printed.count("cached") == 4 and "tape / seed 2: to run" in printed and "rope / seed 2: to run" in printed
    restored, original = comparison(elsewhere), comparison(compared)
    for run in ("tape/seed0", "rope/seed1"):
        for name in ("result.json", "eval.json", "metrics.jsonl"):
            assert (restored / run / name).read_bytes() == (original / run / name).read_bytes()
        assert not (restored / run / "model").exists()
    assert aggregate(restored, write=False)["rows"]["tape"]["seeds"] == [0, 1, 2]
    tampered = archive / "addition" / original.name / "tape" / "seed0" / "result.json"
    result = json.loads(tampered.read_text())
    tampered.write_text(json.dumps({**result, "identity": {**result["identity"], "pe": "rope"}}))
    third = tmp_path / "third-machine"
    capsys.readouterr()
    assert (
        main(
            [
                "compare",
                "addition",
                "--pe",
                "tape",
                "--seeds",
                "0",
                "--root",
                str(third),
                "--archive",
                str(archive),
                *TINY,
            ]
        )
        == 2
    )
    assert "trained with other settings (different pe)" in capsys.readouterr().err
    assert not (third / "compare" / "addition" / original.name / "tape").exists()
    tampered.write_text("{")
    assert (
        main(
            [
                "compare",
                "addition",
                "--pe",
                "tape",
                "--seeds",
                "0",
                "--root",
                str(third),
                "--archive",
                str(archive),
                *TINY,
            ]
        )
        == 2
    )
    assert "has an unreadable result.json" in capsys.readouterr().err
    assert main(["compare", "addition", "--root", str(third), "--archive", str(tmp_path / "missing"), *TINY]) == 2
    assert f"--archive folder '{tmp_path / 'missing'}' does not exist" in capsys.readouterr().err


def test_splice_replaces_only_its_block() -> None:
    doc = "top\n<!-- tapelm-report:begin a -->\nold\n<!-- tapelm-report:end a -->\nbottom\n"
    assert splice(doc, "a", "new") == "top\n<!-- tapelm-report:begin a -->\nnew\n<!-- tapelm-report:end a -->\nbottom\n"
    assert splice("top\n", "b", "x").endswith("<!-- tapelm-report:begin b -->\nx\n<!-- tapelm-report:end b -->\n")


def test_compare_rejects_bad_input_before_running(tmp_path) -> None:
    base = RunSpec(task="addition", pe="tape")
    with pytest.raises(ValueError, match="unknown encoding 'rotary'"):
        compare(base, ["tape", "rotary"], [0], root=tmp_path)
    with pytest.raises(ValueError, match="seeds=\\[-1\\] is not allowed"):
        compare(base, ["tape"], [-1], root=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_reading_states_tape_against_each_baseline_from_paired_intervals() -> None:
    from tapelm.report.tasks_section import reading

    row = {"seeds": [0, 1], "in_distribution": stat(5.0, 0.1), "longer": stat(9.0, 0.5)}

    def log_ratio(mean, half):
        return {
            key: {"mean": mean, "half_width": half, "n": 3, "std": 0.0, "seeds": [0, 1, 2]}
            for key in ("in_distribution", "longer", "all")
        }

    summary = {
        "rows": {"tape": row, "fire": row, "rope": row},
        "metric": "perplexity",
        "task": "text",
        "paired": {"fire": log_ratio(0.21, 0.1), "rope": log_ratio(-0.04, 0.3)},
    }
    sentences = reading(summary)
    assert any(s.startswith("TAPE is behind fire on the longer lengths") for s in sentences)  # higher perplexity
    assert any("includes 1 against rope" in s for s in sentences)  # a ratio of perplexities


def test_reading_flags_a_gap_to_a_baseline_that_did_not_learn_in_distribution() -> None:
    from tapelm.report.tasks_section import reading

    learned = {
        "seeds": [0, 1],
        "in_distribution": stat(1.0, 0.0),
        "longer": stat(0.9, 0.01),
        "per_seed": {"in_distribution": {0: 1.0, 1: 1.0}},
    }
    unlearned = {
        "seeds": [0, 1],
        "in_distribution": stat(0.8, 0.01),
        "longer": stat(0.7, 0.01),
        "per_seed": {"in_distribution": {0: 0.995, 1: 0.605}},
    }
    ahead = {
        key: {"mean": 0.1, "half_width": 0.05, "n": 2, "std": 0.0, "seeds": [0, 1]}
        for key in ("in_distribution", "longer", "all")
    }
    summary = {
        "rows": {"tape": learned, "rope": learned, "nope": unlearned},
        "metric": "accuracy",
        "task": "flipflop",
        "paired": {"rope": ahead, "nope": ahead},
    }
    sentences = [s for s in reading(summary) if s.startswith("TAPE is ahead of rope, nope")]
    assert len(sentences) == 1 and "nope did not learn the task in distribution" in sentences[0]
    assert "rope did not learn" not in sentences[0]
    # the recipe's robustness per encoding: a mean below the bar can hide a seed that learned (flip-flop's is 99%)
    assert (
        "Seeds that learn on their own (≥ 99.0% in distribution): tape 2 of 2 (lowest 100.0%), rope 2 of 2 "
        "(lowest 100.0%), nope 1 of 2 (lowest 60.5%)."
    ) in reading(summary)


def test_reading_says_where_an_unlearned_encodings_curves_stood() -> None:
    from tapelm.report.tasks_section import reading

    learned = {
        "seeds": [0, 1],
        "in_distribution": stat(1.0, 0.0),
        "longer": stat(0.0, 0.0),
        "per_seed": {"in_distribution": {0: 1.0, 1: 1.0}},
    }
    unlearned = {**learned, "in_distribution": stat(0.85, 0.05), "per_seed": {"in_distribution": {0: 0.9, 1: 0.8}}}
    rising = {"0": [[100, 0.1], [300, 0.5], [400, 0.9]], "1": [[100, 0.1], [300, 0.4], [400, 0.8]]}
    summary = {
        "rows": {"tape": learned, "randpe": unlearned, "fire": unlearned},
        "metric": "exact_match",
        "task": "addition",
        "paired": {},
        "learning_curves": {"randpe": rising, "fire": {"0": [[100, 0.8], [300, 0.85]], "1": [[100, 0.8], [200, 0.85]]}},
    }
    (sentence,) = [s for s in reading(summary) if s.startswith("Below 95.0% exact match")]
    # randpe: the evaluation nearest three quarters of training (step 300) against the last, averaged over seeds;
    # fire's seeds were evaluated at different steps, so no trend is claimed for it
    assert sentence.endswith(
        "randpe (learning curves, mean over seeds: 45.0% at step 300, 85.0% at 400, still rising), fire."
    )
    flat = {seed: [[step, 0.85] for step, _ in points] for seed, points in rising.items()}
    (sentence,) = [s for s in reading({**summary, "learning_curves": {"randpe": flat}}) if s.startswith("Below 95.0%")]
    assert "randpe (learning curves, mean over seeds: 85.0% at step 300, 85.0% at 400, flat), fire." in sentence


def test_reading_reports_the_state_norm_of_the_equivariance_ablation() -> None:
    from tapelm.report.tasks_section import reading

    row = {
        "seeds": [0, 1],
        "in_distribution": stat(1.0, 0.0),
        "longer": stat(0.5, 0.01),
        "per_seed": {"in_distribution": {0: 1.0, 1: 1.0}},
    }
    growing = {"steps": [10, 20, 30], "norms": [[1.0, 1.2], [1.0, 0.9], [1.0, 1.5]]}
    summary = {
        "rows": {"tape": row, "tape-non-equivariant": row},
        "metric": "accuracy",
        "task": "mqar",
        "paired": {},
        "state_norms": {"tape-non-equivariant": growing},
    }
    (sentence,) = [s for s in reading(summary) if s.startswith("Norm of TAPE's positional state")]
    assert "tape-non-equivariant 1.500 at step 30 (range 0.900–1.500)" in sentence
    assert not any("Norm of TAPE" in s for s in reading({**summary, "state_norms": {"tape": growing}}))


def test_mqar_reading_gives_the_score_of_elimination_without_recall() -> None:
    """Answering the k-th of n queries with one of the n - k + 1 values not yet asked for scores H(n)/n."""
    from tapelm.report.tasks_section import reading

    row = {
        "seeds": [0],
        "in_distribution": stat(1.0, 0.0),
        "longer": stat(0.5, 0.0),
        "per_seed": {"in_distribution": {0: 1.0}},
    }
    summary = {
        "rows": {"tape": row},
        "metric": "accuracy",
        "task": "mqar",
        "paired": {},
        "record": {"task_options": {"num_pairs": 2, "eval_multipliers": [1, 4]}},
    }
    (sentence,) = [s for s in reading(summary) if s.startswith("MQAR accuracy")]
    assert sentence.endswith("75.0% at 2, 34.0% at 8.")  # (1 + 1/2) / 2 and H(8) / 8


def test_a_runs_result_does_not_depend_on_how_many_runs_share_a_device(compared, tmp_path) -> None:
    """Two runs at once on one device (given explicitly, as a machine's GPU would be: each worker pinned to it
    through CUDA_VISIBLE_DEVICES, here on the CPU) train the same models as one run at a time: every run's losses and
    evaluation equal the sequential ones, and each result records its device."""
    from tapelm.training.launchers import LocalLauncher

    spec = json.loads((comparison(compared) / "comparison.json").read_text())
    base = RunSpec(
        task="addition",
        pe="tape",
        task_options=spec["task_options"],
        model_options=spec["model_options"],
        train_options={k: spec["train"][k] for k in ("steps", "batch_size", "warmup", "eval_every")},
        eval_n=spec["eval"]["n"],
    )
    compare(base, ["tape", "rope"], [0, 1], root=tmp_path, progress=False, launcher=LocalLauncher(2, devices=["1"]))
    sequential, parallel = comparison(compared), comparison(tmp_path)
    assert parallel.name == sequential.name
    pinned = []
    for result in parallel.glob("*/seed*/result.json"):
        mine = json.loads(result.read_text())
        theirs = json.loads((sequential / result.relative_to(parallel)).read_text())
        assert mine["summary"] == theirs["summary"] and mine["final_loss"] == theirs["final_loss"]
        losses = [
            [json.loads(line).get("loss") for line in (path.parent / "metrics.jsonl").read_text().splitlines()]
            for path in (result, sequential / result.relative_to(parallel))
        ]
        assert losses[0] == losses[1]
        assert mine["launch"]["runs_per_device"] == 2
        pinned.append((mine["launch"]["device_slot"], mine["device"]["cuda_visible_devices"]))
    assert pinned == [("1", "1")] * 4


def test_ablation_variants_are_encodings_with_options(tmp_path, capsys) -> None:
    from tapelm.experiments.runs import resolve

    run = resolve(RunSpec(task="addition", pe="tape-non-equivariant"))
    assert run.config.pe_type == "tape" and run.config.tape_equivariant is False
    assert resolve(RunSpec(task="addition", pe="tape-second-half")).config.tape_layers == "second_half"
    assert main(["ablate", "addition", "--variants", "tape", "tape-sideways", "--root", str(tmp_path)]) == 2
    assert "unknown ablation variant 'tape-sideways'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="or a variant: tape-per-head"):
        resolve(RunSpec(task="addition", pe="tape-sideways"))
    assert list(tmp_path.iterdir()) == []


def test_the_rope_familys_options_are_encodings_of_their_own() -> None:
    """p-RoPE, the NoPE schedules and the attention's options are rows by name: an encoding with their options,
    listed as encodings."""
    from tapelm.experiments.runs import resolve
    from tapelm.positional.schedule import layer_encodings
    from tapelm.report.findings_section import name

    scheduled = resolve(RunSpec(task="flipflop", pe="rope-nope-every-4th")).config
    assert scheduled.pe_type == "rope" and layer_encodings(scheduled) == ["rope", "rope", "rope", "nope"]
    interleaved = resolve(RunSpec(task="flipflop", pe="rope-nope-every-2nd")).config
    assert layer_encodings(interleaved) == ["rope", "nope", "rope", "nope"]
    assert resolve(RunSpec(task="flipflop", pe="p-rope-0.75")).config.rope_fraction == 0.75
    assert name("p-rope-0.75") == "p-RoPE (0.75)"
    gated = resolve(RunSpec(task="flipflop", pe="tape-gated")).config
    assert gated.pe_type == "tape" and gated.attention_gate == "elementwise" and not gated.ssmax
    assert resolve(RunSpec(task="flipflop", pe="rope-ssmax")).config.ssmax
    llama4 = resolve(RunSpec(task="flipflop", pe="rope-nope-every-4th-temp128")).config
    assert layer_encodings(llama4) == ["rope", "rope", "rope", "nope"] and llama4.nope_temperature_tuning
    assert llama4.nope_floor_scale == 128 and llama4.nope_attn_scale == 0.1
    assert name("tape-ssmax") == "TAPE + SSMax"
    with pytest.raises(ValueError, match="temp16, any encoding gated .its name . '-gated'., a row evaluated from an"):
        resolve(RunSpec(task="flipflop", pe="rope-sideways"))


@pytest.mark.parametrize("pe", encoding_names())
def test_every_encoding_gated_is_a_row_of_its_own(pe) -> None:
    """Any registered encoding plus '-gated' is that encoding with the output gate on, named for it and paired with
    it; a gated name whose stem is no encoding is refused."""
    from tapelm.experiments.runs import resolve
    from tapelm.variants import display_name, with_attention_options, without_attention_options

    config = resolve(RunSpec(task="flipflop", pe=f"{pe}-gated")).config
    assert config.pe_type == pe and config.attention_gate == "elementwise" and not config.ssmax
    assert with_attention_options(f"{pe}-gated") and not with_attention_options(pe)
    assert without_attention_options(f"{pe}-gated") == pe
    assert display_name(f"{pe}-gated").endswith(", gated attention")
    with pytest.raises(ValueError, match=f"unknown encoding '{pe}-sideways-gated'"):
        resolve(RunSpec(task="flipflop", pe=f"{pe}-sideways-gated"))


def test_ablation_rows_get_their_own_report_table(compared, tmp_path) -> None:
    """Variants added to a comparison (`tapelm ablate`) are reported apart: the encodings' table keeps its rows, and
    an ablation table holds full TAPE, RoPE and the variants, with their commands and figures."""
    import shutil

    root = tmp_path / "runs"
    shutil.copytree(compared, root)
    assert (
        main(
            [
                "ablate",
                "addition",
                "--variants",
                "tape",
                "rope",
                "tape-mlp-only",
                "--seeds",
                "0",
                "1",
                "--root",
                str(root),
                *TINY,
            ]
        )
        == 0
    )
    out = tmp_path / "docs" / "RESULTS.md"
    build_report(root, out)
    text = out.read_text()
    encodings, ablation = text.split("### addition — tape, rope")[1].split("### addition — ablation: ")
    assert ablation.startswith("tape, rope, tape-mlp-only\n") and "| tape-mlp-only |" in ablation
    assert "tape-mlp-only" not in encodings and "| tape |" in encodings and "| rope |" in encodings
    assert "tapelm ablate addition --variants tape rope tape-mlp-only --seeds 0 1" in ablation
    assert "--pe tape rope --seeds 0 1" in encodings and "tapelm ablate" not in encodings
    figures = [p.name for p in (tmp_path / "docs" / "figures").iterdir()]
    assert any("-ablation-addition-heatmaps.png" in name for name in figures)
    assert "| tape-mlp-only | 0,1 |" in ablation  # its paired difference to full TAPE


def _process_state(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) from /proc, or None once the process is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def _children(pid: int) -> set[int]:
    return {
        int(p.name) for p in Path("/proc").glob("[0-9]*") if (state := _process_state(int(p.name))) and state[1] == pid
    }


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_killing_a_parallel_comparison_ends_its_workers(tmp_path) -> None:
    import signal
    import subprocess
    import sys
    import time

    long = [arg if arg != "6" else "100000" for arg in TINY]  # runs that would outlive the test
    parent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tapelm.cli",
            "compare",
            "addition",
            "--pe",
            "tape",
            "rope",
            "--jobs",
            "2",
            "--root",
            str(tmp_path),
            *long,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while len(workers := _children(parent.pid)) < 2 and time.time() < deadline:
        time.sleep(0.5)
    time.sleep(3)  # past the workers' start-up
    parent.send_signal(signal.SIGTERM)
    parent.wait(30)
    deadline = time.time() + 30
    while (alive := {pid for pid in workers if (_process_state(pid) or ("Z",))[0] != "Z"}) and time.time() < deadline:
        time.sleep(0.5)
    assert len(workers) >= 2 and not alive


def test_owed_comparisons_name_their_missing_runs_and_the_command_that_runs_them() -> None:
    from dataclasses import replace

    from tapelm.experiments.plan import OwedComparison

    owed = OwedComparison("passkey", ("tape", "rope", "nope"), 2, "test")
    assert owed.missing({"tape": {0, 1, 7}, "rope": {1, 5}}) == {"rope": 1, "nope": 0}  # seed 5 is not owed
    assert owed.command(["rope", "nope"]) == "tapelm compare passkey --pe rope nope --seeds 0 1"
    assert replace(owed, ablation=True).command(["tape-r4"]) == "tapelm ablate passkey --variants tape-r4 --seeds 0 1"
    assert owed.command(["nope"], "docs/results/compare") == (
        "tapelm compare passkey --pe nope --seeds 0 1 --archive docs/results/compare"
    )


def test_an_owed_design_names_the_command_that_writes_where_it_is_read() -> None:
    """A comparison owed at a design of its task (options over the preset) is read from the folder its command
    writes: the command, parsed by the CLI, has the owed settings hash, which is not the default recipe's."""
    import shlex

    from tapelm.cli import build_parser
    from tapelm.experiments.commands import spec_from_args

    designs = [owed for owed in OWED if owed.task_options or owed.train_options]
    assert {owed.ablation for owed in designs} == {False, True}
    for owed in designs:
        args = build_parser().parse_args(shlex.split(owed.command(["tape"]))[1:])
        parsed = settings_hash(spec_from_args(args, "tape", 0))
        assert parsed == owed.settings_hash() != default_settings_hash(owed.task)


def test_coverage_reads_the_archive_at_the_default_recipe(tmp_path) -> None:
    """A comparison counts where `tapelm compare TASK` writes (the default preset's settings hash): its finished
    seeds make it complete or partial; a folder under another hash (other settings) does not count."""
    from tapelm.report.coverage_section import build
    from tapelm.report.sections import ReportContext

    owed = next(o for o in OWED if o.task == "passkey" and not o.ablation)
    archive = tmp_path / "compare"
    for folder, seeds in ((owed.settings_hash(), range(owed.seeds)), ("0000000000", [0])):
        for row in owed.rows:
            for seed in seeds:
                if (row, seed) != ("alibi", 2):
                    run = archive / "passkey" / folder / row / f"seed{seed}"
                    run.mkdir(parents=True)
                    (run / "result.json").write_text(json.dumps({"pe": row, "seed": seed}))
                    (run / "eval.json").write_text("{}")
    text = build(ReportContext(root=tmp_path, figures=tmp_path, figures_link=".", comparisons=archive))
    line = next(line for line in text.splitlines() if line.startswith(f"| `passkey` {owed.settings_hash()}, "))
    assert f"| partial: alibi 2/3 | `tapelm compare passkey --pe alibi --seeds 0 1 2 --archive {archive}` |" in line
    (archive / "passkey" / owed.settings_hash() / "alibi" / "seed2").mkdir()
    (archive / "passkey" / owed.settings_hash() / "alibi" / "seed2" / "result.json").write_text(
        json.dumps({"pe": "alibi", "seed": 2})
    )
    (archive / "passkey" / owed.settings_hash() / "alibi" / "seed2" / "eval.json").write_text("{}")
    text = build(ReportContext(root=tmp_path, figures=tmp_path, figures_link=".", comparisons=archive))
    assert f"| `passkey` {owed.settings_hash()}, {owed.label} | {' '.join(owed.rows)} | 3 | complete |  |" in text
    assert "| `mqar` " in text and "| not run | `tapelm compare mqar --pe" in text


def test_claims_are_judged_at_the_current_recipe_once_it_has_the_subject() -> None:
    """A recipe change starts a new comparison folder: its claims are judged there even while an older folder has
    more finished runs; before the new one has the claim's subject, the fullest older one is used."""
    from tapelm.report.claims_section import best_comparison

    def summary(settings_hash: str, rows: dict[str, list[int]], **task_options) -> dict:
        return {
            "task": "addition",
            "settings_hash": settings_hash,
            "record": {"task_options": task_options},
            "rows": {pe: {"seeds": seeds} for pe, seeds in rows.items()},
        }

    arithmetic, hinted, r4 = (
        next(c for c in CLAIMS if c.name == name)
        for name in ("arithmetic", "arithmetic-index-hints", "ablation-equivariance-addition")
    )
    old = summary("old", {"tape": [0, 1, 2, 3, 4], "rope": [0, 1, 2, 3, 4], "nope": [0, 1]})
    small_old = summary("older", {"tape": [0], "rope": [0]})
    current = summary("new", {"tape": [0], "rope": [0]})
    assert best_comparison([small_old, old, current], arithmetic, "new") is current
    assert best_comparison([small_old, old, current], arithmetic, "absent") is old
    assert best_comparison([small_old, old, summary("new", {"rope": [0]})], arithmetic, "new") is old
    assert best_comparison([old], replace(r4, subject="tape-r4"), "new") is None
    # a claim reads only comparisons of its design: the plain format's claims never the index-hints runs
    hints = summary("hints", {"tape": [0, 1, 2, 3, 4, 5], "rope": [0, 1, 2, 3, 4, 5]}, format="index_hints")
    explicit_plain = summary("plain", {"tape": [0], "rope": [0]}, format="plain", max_train_digits=4)
    assert best_comparison([old, hints], arithmetic, "absent") is old
    assert best_comparison([old, hints], hinted, "absent") is hints
    assert best_comparison([explicit_plain], arithmetic, "absent") is explicit_plain
    assert best_comparison([old, explicit_plain], hinted, "absent") is None


def test_only_a_default_preset_comparison_at_other_settings_is_superseded() -> None:
    current = default_settings_hash("addition")
    assert superseded_by("addition", "cpu-small", current) is None
    assert superseded_by("addition", "cpu-small", "0123456789") == current
    designs = {owed.settings_hash() for owed in OWED if owed.task == "addition"} - {current}
    assert designs and all(superseded_by("addition", "cpu-small", design) is None for design in designs)
    assert superseded_by("addition", "paper", "0123456789") is None
