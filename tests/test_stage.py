"""The comparisons at GPU scale, without a GPU: the `gpu` presets (every planned task and encoding trains at tiny
sizes; a thousand times the laptop's FLOPs on the laptop's test sets), the stage's plan (its learning-curve check
first, estimates from finished runs, never a run that cannot finish) and the stage itself (small records that the
next stage continues from), and the report's verdicts per scale."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

from tapelm.cli import main
from tapelm.experiments.budget import (
    OVERHEAD_SECONDS,
    Rate,
    archived_rates,
    current_rate,
    gpu_budget,
    predicted_seconds,
    step_cost,
    training_flops,
)
from tapelm.experiments.claims import CLAIMS
from tapelm.experiments.plan import AT_GPU_SCALE, GPU, at_laptop_scale
from tapelm.experiments.runs import RunOptions, resolve, run_task
from tapelm.experiments.stage import (
    MARGIN,
    PlannedRun,
    Schedule,
    claims_of,
    ordered_runs,
    owed_spec,
    run_stage,
)
from tapelm.positional import registered
from tapelm.report.claims_section import current_hash

TINY = {
    "model_options": {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
    },
    "train_options": {"steps": 1, "batch_size": 2, "warmup": 0, "eval_every": 1},
    "eval_n": 8,
    "eval_batch_size": 16,
}
TINY_FLAGS = [
    "--steps",
    "1",
    "--batch-size",
    "2",
    "--warmup",
    "0",
    "--eval-every",
    "1",
    "--eval-n",
    "8",
    "--no-progress",
    *(f"--model-option={k}={v}" for k, v in TINY["model_options"].items()),
]
TEXT = next(owed for owed in AT_GPU_SCALE if owed.task == "text")
ARCHIVE = Path(__file__).resolve().parents[1] / "docs" / "results" / "compare"


def test_every_planned_encoding_trains_one_step_of_its_gpu_recipe_at_tiny_size(tmp_path) -> None:
    """The recipes as the stage runs them (bf16 autocast, the laptop's task options), shrunk to one step."""
    for index, owed in enumerate(AT_GPU_SCALE):
        for pe in owed.rows:
            spec = replace(owed_spec(owed, TINY), pe=pe)
            result = run_task(resolve(spec), tmp_path / f"{index}-{pe}", RunOptions(progress=False))
            assert result["identity"]["train"]["mixed_precision"] == "bf16" and result["preset"] == GPU
            assert result["first_loss"] == result["final_loss"] and math.isfinite(result["final_loss"])


def test_each_gpu_recipe_has_three_hundred_times_the_laptop_flops_on_the_laptop_test_sets() -> None:
    """Against the laptop comparison of the same task and design: at least 300x its training FLOPs, the same task
    options and evaluation (so the same test sets), and the check's runs within one visit command (600 s) at the
    rate the archived GPU runs measured."""
    rate = current_rate(archived_rates(ARCHIVE))
    for owed in AT_GPU_SCALE:
        laptop = at_laptop_scale(owed)
        assert laptop.preset == "cpu-small" and laptop.task == owed.task and not laptop.ablation
        gpu_run, laptop_run = resolve(replace(owed.spec(), pe="rope")), resolve(replace(laptop.spec(), pe="rope"))
        assert training_flops(gpu_run) >= 300 * training_flops(laptop_run), owed.label
        assert (
            gpu_run.task_options == laptop_run.task_options and gpu_run.identity["eval"] == laptop_run.identity["eval"]
        )
        assert gpu_run.settings.mixed_precision == "bf16" and laptop_run.settings.mixed_precision == "no"
        seconds = predicted_seconds(replace(gpu_run, spec=replace(gpu_run.spec, pe="tape")), rate)
        assert OVERHEAD_SECONDS + MARGIN * seconds < 600, owed.label


def schedule(*finished: tuple[int, str, int, float, bool], flops=(100.0, 100.0)) -> Schedule:
    """Two comparisons of rows rope, tape, fire, nope (seeds 0 and 1) whose RoPE runs are predicted at their FLOPs
    (one FLOP a second), with the given finished runs, each measuring the rate its seconds say (newer code)."""
    owed = replace(TEXT, rows=("rope", "tape", "fire", "nope"), seeds=2)
    runs = ordered_runs([owed, owed])
    for comparison, pe, seed, seconds, learned in finished:
        run = next(r for r in runs if (r.comparison, r.pe, r.seed) == (comparison, pe, seed))
        run.seconds, run.learned = seconds, learned
        run.rate = Rate(flops[comparison] * step_cost(pe) / seconds, "finished", "new", "2")
    return Schedule(runs, list(flops), [Rate(1.0, "archived", "old", "1")])


def by_key(plan: Schedule, comparison: int, pe: str, seed: int) -> PlannedRun:
    return next(r for r in plan.runs if (r.comparison, r.pe, r.seed) == (comparison, pe, seed))


def test_every_claims_pair_runs_first_each_comparison_starting_with_its_check() -> None:
    """Comparison by comparison RoPE's and TAPE's runs on every seed, the check first; then the other encodings,
    which wait until every claim has its pair; a comparison whose check did not learn stops, the others go on."""
    plan = schedule()
    assert [(r.comparison, r.pe, r.seed) for r in plan.runs] == [
        (0, "rope", 0),
        (0, "tape", 0),
        (0, "rope", 1),
        (0, "tape", 1),
        (1, "rope", 0),
        (1, "tape", 0),
        (1, "rope", 1),
        (1, "tape", 1),
        (0, "fire", 0),
        (0, "nope", 0),
        (0, "fire", 1),
        (0, "nope", 1),
        (1, "fire", 0),
        (1, "nope", 0),
        (1, "fire", 1),
        (1, "nope", 1),
    ]
    assert plan.next_run(1e9)[0] == plan.runs[0]
    assert "waits for RoPE's and TAPE's seed 0" in plan.waiting(by_key(plan, 0, "rope", 1))
    plan = schedule((0, "rope", 0, 50.0, True), (0, "tape", 0, 60.0, True))
    assert plan.next_run(1e9)[0] is by_key(plan, 0, "rope", 1)
    assert plan.waiting(by_key(plan, 0, "fire", 0)) == "waits until every claim has its TAPE/RoPE pair"
    pairs = [(c, pe, seed, 50.0, True) for c in (0, 1) for pe in ("rope", "tape") for seed in (0, 1)]
    plan = schedule(*pairs[:-1])
    assert plan.waiting(by_key(plan, 0, "fire", 0)) and plan.next_run(1e9)[0] is by_key(plan, 1, "tape", 1)
    plan = schedule(*pairs)
    assert plan.waiting(by_key(plan, 0, "fire", 0)) is None and plan.next_run(1e9)[0] is by_key(plan, 0, "fire", 0)
    plan = schedule((0, "rope", 0, 50.0, True), (0, "tape", 0, 60.0, False))
    assert plan.stopped(0) == "tape seed 0 did not learn the task in distribution: change the recipe"
    assert all(plan.waiting(run) for run in plan.open_runs(0))
    assert plan.next_run(1e9)[0] is by_key(plan, 1, "rope", 0)  # the next comparison goes on
    stopped_pairs = [run for run in pairs if run[0] == 1] + [(0, "rope", 0, 50.0, True), (0, "tape", 0, 60.0, False)]
    plan = schedule(*stopped_pairs)  # a stopped comparison's pair holds back no other encoding
    assert plan.next_run(1e9)[0] is by_key(plan, 1, "fire", 0)
    with pytest.raises(ValueError, match="needs the rows rope, tape for its learning-curve check"):
        ordered_runs([replace(TEXT, rows=("rope", "nope"))])


def test_no_run_starts_that_its_estimate_says_cannot_finish() -> None:
    """The first run in order whose estimate fits the time left; a cheaper later one when the next does not fit;
    none when nothing fits."""
    plan = schedule(
        *(
            (c, pe, seed, 100.0 if pe == "rope" else 150.0, True)
            for c in (0, 1)
            for pe in ("rope", "tape")
            for seed in (0, 1)
        )
    )
    fire, nope = (OVERHEAD_SECONDS + MARGIN * 100.0 * step_cost(pe) for pe in ("fire", "nope"))
    assert nope < fire
    assert plan.next_run(fire)[0].pe == "fire"
    assert plan.next_run(fire - 1)[0].pe == "nope"  # fire, next in order, would not finish
    assert plan.next_run(nope - 1) is None and plan.next_run(OVERHEAD_SECONDS) is None


def test_estimates_come_from_finished_runs_when_there_are_any() -> None:
    plan = schedule()  # nothing timed: the prediction
    assert plan.estimate(plan.runs[0])[0] == OVERHEAD_SECONDS + MARGIN * 100.0
    # RoPE took twice its prediction: every prediction doubles, here and in the next comparison
    plan = schedule((0, "rope", 0, 200.0, True))
    assert plan.estimate(plan.runs[1])[0] == pytest.approx(OVERHEAD_SECONDS + MARGIN * 200.0 * step_cost("tape"))
    assert plan.estimate(by_key(plan, 1, "rope", 0))[0] == pytest.approx(OVERHEAD_SECONDS + MARGIN * 200.0)
    # a run's own encoding's finished runs; an encoding's ratio to RoPE measured in one comparison serves the next
    plan = schedule(
        (0, "rope", 0, 100.0, True),
        (0, "tape", 0, 120.0, True),
        (0, "tape", 1, 130.0, True),
        (1, "rope", 0, 300.0, True),
    )
    assert plan.estimate(next(r for r in plan.runs if (r.comparison, r.pe, r.seed) == (0, "tape", 1)))[
        0
    ] == pytest.approx(OVERHEAD_SECONDS + MARGIN * 130.0)
    assert plan.cost("tape") == (pytest.approx(1.25), "measured") and plan.cost("fire") == (step_cost("fire"), "bench")
    tape = next(r for r in plan.runs if (r.comparison, r.pe, r.seed) == (1, "tape", 0))
    assert plan.estimate(tape)[0] == pytest.approx(OVERHEAD_SECONDS + MARGIN * 300.0 * 1.25)


def test_runs_sharing_a_gpu_are_priced_by_its_measured_throughput_and_as_alone_where_none_is_measured(
    monkeypatch,
) -> None:
    """k runs on one GPU whose measured throughput is f times one run's: each takes k / f times its time alone."""
    from tapelm.experiments import budget

    assert gpu_budget().sharing == {}  # none measured yet (docs/gpu/budget.json)
    assert budget.shared_slowdown(2) == (1.0, "2 per GPU, priced as alone: sharing unmeasured")
    monkeypatch.setattr(budget, "gpu_budget", lambda: replace(gpu_budget(), sharing={2: 1.6}))
    assert budget.shared_slowdown(1) == (1.0, "alone")
    assert budget.shared_slowdown(2) == (1.25, "2 per GPU at 1.60x one run's throughput (measured)")
    assert budget.shared_slowdown(4)[0] == 1.0
    plan = schedule()
    first = plan.runs[0]
    assert plan.estimate(first, 1.25)[0] == pytest.approx(OVERHEAD_SECONDS + MARGIN * 100.0 * 1.25)
    alone = plan.estimate(first)[0]
    assert plan.next_run(alone)[0] is first  # it fits alone
    assert all(run is not first for run, _, _ in plan.startable(alone, 1.25))  # not beside another


def test_the_rate_is_the_slowest_measured_by_the_newest_code_and_the_bench_before_any() -> None:
    old, slow, fast = Rate(1.0, "a", "old", "1"), Rate(2.0, "b", "new", "2"), Rate(3.0, "c", "new", "3")
    assert current_rate([old, fast, slow]) is slow and current_rate([old]) is old
    assert current_rate([]).source.startswith("bench speed")


def test_step_costs_are_the_encodings_facts_and_an_estimate_says_it_is_one() -> None:
    """Each encoding declares its step cost on its class; GRAPE's, PoPE's, Wall's, stick-breaking's and Selective
    RoPE's, which no GPU measured, are their estimates with their provenance (not the largest measured cost), and the
    stage says an estimate is one. A row without a declared cost (an encoding that declares none, a variant) is priced
    at the largest."""
    declared = {pe: cls.step_cost for pe, cls in registered().items() if cls.step_cost is not None}
    estimated = {pe for pe, cost in declared.items() if not cost.measured}
    assert estimated == {
        "grape-m-fixed",
        "grape-m",
        "grape-ap",
        "grape-a-q",
        "grape-a-k",
        "grape-a-qk",
        "pope",
        "wall",
        "stickbreaking",
        "selective-rope",
    }
    assert all(declared[pe].source.strip() and "measured" in declared[pe].source for pe in estimated)
    schedule = Schedule([], [], [])
    measured = {pe: cost.ratio for pe, cost in declared.items() if pe not in estimated}
    for pe in sorted(estimated):
        assert schedule.cost(pe) == (declared[pe].ratio, "estimated") == (step_cost(pe), "estimated")
        assert pe == "wall" or step_cost(pe) < max(measured.values())  # Wall's reference is estimated above PaTH's
    assert schedule.cost("path") == (max(measured.values()), "bench")
    largest = max(cost.ratio for cost in declared.values())
    assert step_cost("sinusoidal") == step_cost("p-rope-0.75") == largest


def test_the_prediction_says_which_gain_each_budget_needs_and_lists_the_unmeasured_one_apart() -> None:
    """Minutes left, the pairs' apart, against the budgets; a budget exceeded says the gain it needs; the minutes
    under the unmeasured gain stand apart and change nothing else."""
    seconds = 60 * gpu_budget().minutes["pairs"]  # a RoPE run's: the pairs of two comparisons take far more
    plan = schedule(flops=(seconds, seconds))
    prediction = plan.prediction()
    pairs = 2 * 2 * seconds * (1 + step_cost("tape")) / 60
    plan_minutes = pairs + 2 * 2 * seconds * (step_cost("fire") + step_cost("nope")) / 60
    assert prediction["minutes"] == pytest.approx({"pairs": pairs, "plan": plan_minutes})
    assert prediction["gain_needed"] == pytest.approx(
        {"pairs": pairs / gpu_budget().minutes["pairs"], "plan": plan_minutes / gpu_budget().minutes["plan"]}
    )
    assumed = prediction["assuming_unmeasured_gain"]
    assert assumed["minutes"]["pairs"] == pytest.approx(pairs / assumed["gain"])
    assert schedule(flops=(1.0, 1.0)).prediction()["gain_needed"] == {}
    assert prediction["rate"] == {"flops_per_second": 1.0, "source": "archived"}


def test_the_plan_is_predicted_from_gpu_runs_whatever_machine_predicts_it(tmp_path) -> None:
    """The dry run's prediction rests on the archived H100 run's rate (not on timing this machine), is the same
    with and without data workers, and says what it comes from."""
    records = []
    for workers in (0, 12):
        out = tmp_path / f"workers-{workers}"
        assert (
            run_stage(
                600,
                out,
                root=tmp_path / "runs",
                archive=ARCHIVE,
                tasks=["mqar"],
                overrides=TINY,
                data_workers=workers,
                progress=False,
                dry_run=True,
            )
            == 0
        )
        records.append(json.loads((out / "stage.json").read_text()))
    assert records[0]["prediction"] == records[1]["prediction"]
    rate, measured = records[0]["prediction"]["rate"], current_rate(archived_rates(ARCHIVE))
    assert rate == {"flops_per_second": measured.flops_per_second, "source": measured.source}
    assert " on NVIDIA " in measured.source  # the first, mqar/3d8c304917/rope/seed0 on NVIDIA H100 80GB HBM3
    flops = records[0]["rope_runs"][0]["flops"]
    seconds = flops / measured.flops_per_second * sum(step_cost(pe) for pe in AT_GPU_SCALE[0].rows) * 3
    assert records[0]["prediction"]["minutes"]["plan"] == pytest.approx(seconds / 60)
    assert records[0]["comparisons"][0]["next_expected_from"].startswith("FLOPs at")


def test_the_plan_decides_the_papers_from_scratch_claims_cheapest_first() -> None:
    assert [owed.task for owed in AT_GPU_SCALE] == ["mqar", "passkey", "text", "addition", "addition"]
    flops = [training_flops(resolve(replace(owed.spec(), pe="rope"))) for owed in AT_GPU_SCALE]
    assert flops == sorted(flops)
    decided = {name for owed in AT_GPU_SCALE for name in claims_of(owed)}
    assert {
        "retrieval-mqar",
        "arithmetic",
        "arithmetic-index-hints",
        "lm-perplexity",
        "lm-extrapolation",
        "retrieval-passkey",
    } <= decided
    assert all(owed.seeds >= 3 and owed.preset == GPU for owed in AT_GPU_SCALE)
    assert all(
        set(next(c for c in CLAIMS if c.name == name).baselines) <= set(owed.rows)
        for owed in AT_GPU_SCALE
        for name in claims_of(owed)
    )
    # the report judges each claim at GPU scale on the comparison the plan runs for it
    claim = {c.name: c for c in CLAIMS}
    assert current_hash(claim["retrieval-mqar"], GPU) == AT_GPU_SCALE[0].settings_hash()
    assert current_hash(claim["arithmetic"], GPU) == AT_GPU_SCALE[4].settings_hash()
    assert current_hash(claim["arithmetic-index-hints"], GPU) == AT_GPU_SCALE[3].settings_hash()
    assert current_hash(claim["state-tracking"], GPU) is None


def absolute_paths(folder: Path) -> list[str]:
    """Every string in the JSON records under `folder` that is an absolute path."""

    def walk(value):
        if isinstance(value, dict):
            return [found for item in value.values() for found in walk(item)]
        if isinstance(value, list):
            return [found for item in value for found in walk(item)]
        return [value] if isinstance(value, str) and re.search(r"(^|[\s='\"])/[\w.-]+/", value) else []

    records = [
        json.loads(line)
        for path in sorted(folder.rglob("*.json*"))
        for line in ([path.read_text()] if path.suffix == ".json" else path.read_text().splitlines())
    ]
    return walk(records)


def test_a_stage_runs_what_fits_brings_back_small_records_and_the_next_stage_continues(tmp_path, capsys) -> None:
    """Text (a perplexity: its check counts as learned). A budget below every estimate trains nothing; a larger
    one trains the check and copies each run's small files, with device and versions and no absolute path; a stage
    on another machine, given them as its archive, trains only what is left."""
    pair, three = (replace(TEXT, rows=rows, seeds=1) for rows in (("rope", "tape"), ("rope", "tape", "nope")))
    first = tmp_path / "first"
    assert run_stage(OVERHEAD_SECONDS / 2, first, (pair,), root=tmp_path / "runs", overrides=TINY, progress=False) == 0
    record = json.loads((first / "stage.json").read_text())
    assert record["runs"] == [] and record["comparisons"][0]["finished"] == 0 and not (first / "compare").exists()
    second = tmp_path / "second"
    assert run_stage(3600, second, (pair,), root=tmp_path / "runs", overrides=TINY, progress=False) == 0
    record = json.loads((second / "stage.json").read_text())
    assert [(r["pe"], r["seed"]) for r in record["runs"]] == [("rope", 0), ("tape", 0)]
    assert all(r["seconds"] < r["expected_seconds"] for r in record["runs"])
    (folder,) = (second / "compare" / "text").iterdir()
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == [
        "comparison.json",
        *(f"{pe}/seed0/{name}" for pe in ("rope", "tape") for name in ("eval.json", "metrics.jsonl", "result.json")),
    ]
    result = json.loads((folder / "tape" / "seed0" / "result.json").read_text())
    assert result["environment"]["device"] == "cpu" and result["environment"]["torch"] and result["data"]
    assert len(result["environment"]["source_sha256"]) == 64  # the code, where a copied tree has no commit
    assert record["environment"]["device"] == "cpu" and record["environment"]["transformers"]
    assert absolute_paths(second) == []
    third = tmp_path / "third"
    assert (
        run_stage(
            3600,
            third,
            (three,),
            root=tmp_path / "elsewhere",
            archive=second / "compare",
            overrides=TINY,
            progress=False,
            log=print,
        )
        == 0
    )
    assert [(r["pe"], r["seed"]) for r in json.loads((third / "stage.json").read_text())["runs"]] == [("nope", 0)]
    assert sorted(p.name for p in (third / "compare" / "text" / folder.name).iterdir()) == ["comparison.json", "nope"]
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| text, ")][-1]  # the third's
    assert row.startswith(f"| text, the paper's five and ALiBi |  | {folder.name} | ") and row.endswith(
        "| 3 of 3 | 0.0, 0.0 |  |"
    )
    archived = second / "compare" / "text" / folder.name / "rope" / "seed0" / "result.json"
    result = json.loads(archived.read_text())
    archived.write_text(json.dumps({**result, "data": {**result["data"], "held_out_tokens": 1}}))
    with pytest.raises(ValueError, match="was trained on other data"):
        run_stage(
            3600,
            tmp_path / "fourth",
            (three,),
            root=tmp_path / "fourth-runs",
            archive=second / "compare",
            overrides=TINY,
            progress=False,
        )


def test_the_report_judges_each_claim_per_scale_and_says_where_a_scale_has_not_run(tmp_path) -> None:
    """A laptop comparison (seeds 0 and 1) and a GPU one of text (TAPE and RoPE: seed 0, then all three planned):
    each claim is judged at each scale on that scale's own runs; a claim without runs at a scale says "not run"
    there; the claims table has a GPU column; once TAPE and RoPE have the planned seeds, the GPU verdict is on that
    pair, labelled so."""
    from tapelm.report import build_report
    from tapelm.report.claims_section import PAIR_ONLY

    pair = replace(TEXT, rows=("rope", "tape"), seeds=1)
    assert run_stage(3600, tmp_path / "stage", (pair,), root=tmp_path / "gpu-runs", overrides=TINY, progress=False) == 0
    assert (
        main(
            [
                "compare",
                "text",
                "--pe",
                "tape",
                "rope",
                "--seeds",
                "0",
                "1",
                "--root",
                str(tmp_path / "stage"),
                *TINY_FLAGS,
            ]
        )
        == 0
    )
    build_report(tmp_path / "stage", tmp_path / "docs" / "RESULTS.md")
    table = (tmp_path / "docs" / "RESULTS.md").read_text()
    assert "| claim | laptop comparison | laptop | GPU comparison | GPU | laptop, tuned rates |" in table
    claim = r"\| Language modelling: TAPE's perplexity is the lowest at the training length\. \| "
    assert re.search(claim + r"`text` \w+ \| \*\*inconclusive\*\* \| `text` \w+ \| \*\*inconclusive\*\* \|", table)
    assert (
        "| Associative recall (MQAR): TAPE is ahead beyond the training length. | – | not run | – | not run | not run |"
        in table
    )
    results = (tmp_path / "docs" / "RESULTS.md").read_text()
    assert "**lm-perplexity** at laptop scale (in-distribution, perplexity, seeds 0,1): **inconclusive**" in results
    assert "**lm-perplexity** at GPU scale (in-distribution, perplexity, seeds 0): **inconclusive**" in results
    gpu_details = r"\*\*lm-perplexity\*\* at GPU scale [^\n]*\n\n- tape / rope: ×[\d.]+ over seeds 0 → too few seeds"
    assert re.search(gpu_details, results) and PAIR_ONLY not in results
    assert (
        run_stage(
            3600,
            tmp_path / "stage",
            (replace(pair, seeds=TEXT.seeds),),
            root=tmp_path / "gpu-runs",
            overrides=TINY,
            progress=False,
        )
        == 0
    )
    build_report(tmp_path / "stage", tmp_path / "docs" / "RESULTS.md")
    results = (tmp_path / "docs" / "RESULTS.md").read_text()
    pair_details = (
        r"\*\*lm-perplexity\*\* at GPU scale \(in-distribution, perplexity, seeds 0,1,2\): \*\*\w+"
        + re.escape(PAIR_ONLY)
        + r"\*\*\.\n\n- tape / rope: [^\n]*\n- the other baselines \(randpe, nope, "
        r"fire, alibi\) lack some of the planned 3 seeds: judged on TAPE against RoPE only"
    )
    assert re.search(pair_details, results), results[results.index("**lm-perplexity** at GPU") :][:600]


def test_a_failed_run_is_recorded_the_others_run_and_the_stage_exits_nonzero(tmp_path, capsys) -> None:
    """A stale run folder (checkpoints without settings) stops RoPE's check run; TAPE's still runs."""
    args = [
        "stage",
        "--tasks",
        "mqar",
        "--budget-seconds",
        "3600",
        "--out",
        str(tmp_path / "out"),
        "--root",
        str(tmp_path / "runs"),
        *TINY_FLAGS,
    ]
    assert main([*args, "--dry-run"]) == 0
    (folder,) = (tmp_path / "runs" / "compare" / "mqar").iterdir()
    (folder / "rope" / "seed0" / "checkpoints" / "step-00000001").mkdir(parents=True)
    capsys.readouterr()
    assert main(args) == 1
    runs = json.loads((tmp_path / "out" / "stage.json").read_text())["runs"]
    assert [(r["pe"], "failed" in r) for r in runs] == [("rope", True), ("tape", False)]
    assert "holds checkpoints but no settings.json" in runs[0]["failed"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budget-seconds", "0"], "--budget-seconds=0.0 is not allowed; give the seconds the stage may take"),
        (
            ["--budget-seconds", "60", "--tasks", "flipflop"],
            "--tasks='flipflop' is not planned at GPU scale; choose from: mqar, passkey, text, addition",
        ),
        (["--budget-seconds", "60", "--data-workers", "-1"], "--data-workers=-1: give a number of processes >= 0"),
        (["--budget-seconds", "60", "--archive", "missing"], "--archive folder 'missing' does not exist"),
    ],
)
def test_bad_input_is_one_line_exit_2_before_any_work(tmp_path, monkeypatch, capsys, argv, message) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["stage", *argv]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and message in error
    assert list(tmp_path.iterdir()) == []
