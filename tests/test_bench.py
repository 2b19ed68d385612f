"""`tapelm bench training` measures what it says, and refuses bad input before any work."""

import argparse

import pytest

from tapelm.bench import speed, training
from tapelm.config import PE_TYPES


def test_training_bench_reports_every_encoding_and_variant():
    report = training.measure("addition", "cpu-small", ["tape", "rope"], ["padded grid", "real tokens"], steps=1,
                              repeats=1, warmup=1, progress=False)
    assert 0.2 < report["padding_share"] < 0.4  # addition batches are left-padded to their longest problem
    for pe in ("tape", "rope"):
        variants = report["results"][pe]["variants"]
        assert list(variants) == ["padded grid", "real tokens"]
        assert variants["padded grid"]["ratio_to_first"] == 1.0
        assert all(v["tokens_per_s"] > 0 and abs(sum(v["share"].values()) - 1) < 1e-9 for v in variants.values())
    assert report["results"]["tape"]["parameters"] > report["results"]["rope"]["parameters"]
    assert "| tape | real tokens |" in training.format_report(report)


def test_training_bench_refuses_an_unknown_variant(tmp_path):
    args = argparse.Namespace(task="addition", preset="cpu-small", pe=["rope"], variants=["fast"], steps=1,
                              repeats=1, threads=1, out=str(tmp_path), no_progress=True)
    with pytest.raises(ValueError, match="unknown variant 'fast'"):
        training.run_command(args)
    assert not any(tmp_path.iterdir())


def test_speed_bench_measures_every_encoding_with_a_cache():
    tiny = speed.SpeedSize("tiny", 2, 32, 4, 2, 64, 16, 2, 12, 3, 1)
    results = speed.measure(tiny, list(PE_TYPES), progress=False)
    assert list(results) == list(PE_TYPES)
    for pe, result in results.items():
        assert result["decode_tokens_per_s"] > 0 and result["cache_bytes"] > 0, pe
    assert results["tape"]["cache_bytes"] > results["rope"]["cache_bytes"]
