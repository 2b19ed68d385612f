"""Tests for `tapelm extend` (tapelm.pretrained.extend): every row on a tiny Llama, the same budget for every
trained row, resuming, the summary's statistics and verdicts, the report section, and bad input refused early."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tapelm.pretrained.extend import (
    TRAINED,
    Budget,
    ExtendPlan,
    judge_claims,
    ntk_theta,
    results_section,
    run_extension,
    zero_training_model,
)
from tapelm.pretrained.retrofit import EvalPlan
from tapelm.pretrained.sources import load_pretrained
from test_finetune import finetune_inputs  # noqa: F401  (the tiny Llama folder and prose corpus)

WINDOW = 16


def tiny_plan(inputs, out: Path, **changes) -> ExtendPlan:
    eval_plan = EvalPlan(
        lengths=(16, 32, 64, 128), passkey_lengths=(), scored=64, documents=1, trials=1, prose_corpus=inputs["prose"]
    )
    options = dict(
        base=inputs["llama"],
        out=out,
        window=WINDOW,
        factor=2,
        seeds=(0, 1),
        budget=Budget(steps=2, batch_size=1, lr=1e-3, warmup=0, eval_every=1, checkpoint_every=1, train_tokens=2000),
        eval_plan=eval_plan,
        prose_corpus=inputs["prose"],
    )
    options.update(changes)
    return ExtendPlan(**options)


def test_every_trained_row_shares_the_budget_and_differs_only_by_method(finetune_inputs, tmp_path):  # noqa: F811
    plan = tiny_plan(finetune_inputs, tmp_path)
    recipes = {row: plan.settings(row, 1, theta=1e4, head_dim=8).to_dict() for row in TRAINED}
    budget = (
        "train_length",
        "steps",
        "batch_size",
        "grad_accum",
        "lr",
        "warmup",
        "seed",
        "train_tokens",
        "eval_every",
        "prose_corpus",
        "target_length",
        "pretrained_length",
    )
    assert len({json.dumps({k: r[k] for k in budget}) for r in recipes.values()}) == 1
    assert recipes["tape"]["train_length"] == 32 and recipes["tape"]["seed"] == 1
    assert not recipes["tape-no-lora"]["lora"] and not recipes["full"]["lora"] and recipes["lora"]["lora"]
    assert [row for row, r in recipes.items() if r["interpolate_positions"]] == ["longlora"]  # LongLoRA = S²-Attn + PI
    assert recipes["theta"]["theta"] == pytest.approx(ntk_theta(1e4, 2, 8)) == pytest.approx(1e4 * 2 ** (8 / 6))


def test_zero_training_rows_are_the_base_and_its_scalings(finetune_inputs, tmp_path):  # noqa: F811
    source, _ = load_pretrained(finetune_inputs["llama"])
    plan = tiny_plan(finetune_inputs, tmp_path)
    ids = torch.randint(0, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            zero_training_model(source, "base", plan)(ids).logits, source(ids).logits, atol=1e-5, rtol=0
        )
    pi = zero_training_model(source, "pi-zero", plan).config.rope_parameters
    yarn = zero_training_model(source, "yarn-zero", plan).config.rope_parameters
    assert (pi["rope_type"], pi["factor"]) == ("linear", 2.0)
    assert (yarn["rope_type"], yarn["factor"], yarn["original_max_position_embeddings"]) == ("yarn", 2.0, WINDOW)


def test_extension_runs_every_row_resumes_and_reports(finetune_inputs, tmp_path):  # noqa: F811
    plan = tiny_plan(finetune_inputs, tmp_path / "out")
    summary = run_extension(plan, log=lambda line: None)
    assert set(summary["rows"]) == set(plan.rows)
    assert summary["rows"]["tape"]["seeds"] == [0, 1] and summary["rows"]["base"]["seeds"] == []
    for row in TRAINED:
        result = json.loads((plan.results_dir / row / "seed0.json").read_text())
        assert [p["step"] for p in result["train"]["curve"]] == [1, 2]  # validation at the target length
        assert result["trainable"] and all(
            math.isfinite(result["eval"]["perplexity"][c][n]["perplexity"])
            for c in ("code", "prose")
            for n in ("16", "32", "64", "128")
        )
    assert summary["rows"]["full"]["trainable"] > summary["rows"]["lora"]["trainable"]
    # a zero-training row pairs with every seed: TAPE's differences use both seeds
    assert summary["paired"]["base"]["log_perplexity"]["code"]["16"]["seeds"] == [0, 1]
    stamps = {p: p.stat().st_mtime_ns for p in plan.results_dir.rglob("*.json")}
    assert run_extension(plan, log=lambda line: None)["rows"].keys() == summary["rows"].keys()
    assert {p: p.stat().st_mtime_ns for p in plan.results_dir.rglob("*.json")} == stamps  # nothing redone
    with pytest.raises(ValueError, match="holds an extension with other settings \\(different budget\\)"):
        run_extension(replace(plan, budget=replace(plan.budget, steps=3)), log=lambda line: None)
    stale = plan.results_dir / "lora" / "seed1.json"
    record = json.loads(stale.read_text())
    stale.write_text(json.dumps({**record, "settings": {**record["settings"], "lora_rank": 4}}))
    with pytest.raises(ValueError, match="seed1.json' was fine-tuned with other settings \\(different lora_rank\\)"):
        run_extension(plan, log=lambda line: None)
    stale.write_text(json.dumps(record))
    markdown = results_section(plan.results_dir, tmp_path / "figures", "figures")
    assert "| tape |" in markdown and "extension-perplexity" in markdown and "not run" in markdown
    assert (tmp_path / "figures" / "extend-perplexity-code.png").is_file()
    assert (tmp_path / "figures" / "extend-training-prose.png").is_file()


def _summary(tape: list[float], lora: list[float]) -> dict:
    """A summary with TAPE's and LoRA's log-perplexity differences and passkey of given per-seed values."""
    from tapelm.analysis.statistics import paired_difference

    difference = paired_difference(dict(enumerate(tape)), dict(enumerate(lora)))
    rows = {"tape": {"passkey": {"32": {"mean": 0.5}}}, "lora": {"passkey": {"32": {"mean": 0.0}}}}
    return {
        "window": 16,
        "lengths": ["16"],
        "passkey_lengths": ["32"],
        "rows": rows,
        "paired": {
            b: {"log_perplexity": {c: {"16": difference} for c in ("code", "prose")}, "passkey_beyond": difference}
            for b in ("lora", "longlora", "theta")
        },
    }


@pytest.mark.parametrize(
    "tape, other, perplexity, passkey",
    [
        ([1.0, 1.1, 0.9], [2.0, 2.1, 2.05], "confirmed", "refuted"),  # lower log-ppl: better; lower accuracy: worse
        ([2.0, 2.1, 2.05], [1.0, 1.1, 0.9], "refuted", "confirmed"),
        ([1.0, 2.0, 1.5], [1.5, 1.0, 2.0], "inconclusive", "inconclusive"),
        ([1.0], [2.0], "inconclusive", "inconclusive"),  # one seed decides nothing
    ],
)
def test_claims_follow_the_paired_intervals(tape, other, perplexity, passkey):
    verdicts = {claim["name"]: claim["verdict"] for claim in judge_claims(_summary(tape, other))}
    assert verdicts == {"extension-perplexity": perplexity, "extension-passkey": passkey}


def test_a_missing_baseline_leaves_a_won_claim_inconclusive():
    summary = _summary([1.0, 1.1, 0.9], [2.0, 2.1, 2.05])
    del summary["paired"]["theta"]
    verdicts = {claim["name"]: claim["verdict"] for claim in judge_claims(summary)}
    assert verdicts == {"extension-perplexity": "inconclusive", "extension-passkey": "refuted"}


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rows", "tape", "magic"], "rows ['magic'] are not allowed; choose from: base,"),
        (["--seeds", "-1"], "seeds=[-1] are not allowed"),
        (["--factor", "1"], "factor=1 is not allowed; it must be an integer >= 2"),
        (["--jobs", "0"], "--jobs=0 is not allowed; it must be a positive integer"),
        (["--lr", "-1"], "lr=-1.0 is not allowed"),
        (["--preset", "paper", "--base", None], "--preset paper needs --base"),
        (["--pretrained-length", "12"], "eval length 12 is not allowed"),
        ([], "passkey length 16 cannot hold a passkey document with this tokenizer"),
    ],
)
def test_extend_refuses_bad_input_in_one_line_before_any_work(
    finetune_inputs,
    tmp_path,
    capsys,
    extra,  # noqa: F811
    message,
):
    from tapelm.cli import main

    base = ["--base", finetune_inputs["llama"]]
    if None in extra:
        base, extra = [], extra[:2]
    argv = [
        "extend",
        *base,
        "--pretrained-length",
        "16",
        "--out",
        str(tmp_path / "out"),
        "--prose-corpus",
        finetune_inputs["prose"],
        "--eval-documents",
        "1",
        *extra,
    ]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and message in error
    assert not (tmp_path / "out").exists()


def test_a_failing_row_makes_extend_exit_nonzero_after_the_others(
    finetune_inputs,
    tmp_path,
    capsys,  # noqa: F811
    monkeypatch,
):
    from tapelm.cli import main
    from tapelm.pretrained import extend

    def broken(*args, **kwargs):
        raise RuntimeError("this row broke")

    monkeypatch.setattr(extend, "finetune", broken)  # every trained row fails; the zero-training row is still done
    argv = [
        "extend",
        "--base",
        finetune_inputs["llama"],
        "--pretrained-length",
        "16",
        "--out",
        str(tmp_path),
        "--prose-corpus",
        finetune_inputs["prose"],
        "--eval-documents",
        "1",
        "--no-passkey",
        "--rows",
        "base",
        "lora",
        "--seeds",
        "0",
    ]
    assert main(argv) == 1
    assert "1 of 2 results failed (lora/seed0)" in capsys.readouterr().err
    assert (tmp_path / "results" / "base.json").is_file() and not (tmp_path / "results" / "lora").exists()
