"""`tapelm bench training` measures what it says, and refuses bad input before any work."""

import argparse
import gc
import json
import weakref
from dataclasses import replace

import pytest
import torch

from tapelm.bench import speed, training
from tapelm.config import PE_TYPES


def test_training_bench_reports_every_encoding_and_variant():
    report = training.measure(
        "addition",
        "cpu-small",
        ["tape", "rope"],
        ["padded grid", "real tokens"],
        steps=1,
        repeats=1,
        warmup=1,
        progress=False,
    )
    assert 0.2 < report["padding_share"] < 0.4  # addition batches are left-padded to their longest problem
    for pe in ("tape", "rope"):
        variants = report["results"][pe]["variants"]
        assert list(variants) == ["padded grid", "real tokens"]
        assert variants["padded grid"]["ratio_to_first"] == 1.0
        assert all(v["tokens_per_s"] > 0 and abs(sum(v["share"].values()) - 1) < 1e-9 for v in variants.values())
    assert report["results"]["tape"]["parameters"] > report["results"]["rope"]["parameters"]
    assert "| tape | real tokens |" in training.format_report(report)


def test_training_bench_refuses_an_unknown_variant(tmp_path):
    args = argparse.Namespace(
        task="addition",
        preset="cpu-small",
        pe=["rope"],
        variants=["fast"],
        steps=1,
        repeats=1,
        threads=1,
        out=str(tmp_path),
        no_progress=True,
    )
    with pytest.raises(ValueError, match="unknown variant 'fast'"):
        training.run_command(args)
    assert not any(tmp_path.iterdir())


CPU = speed.Options(torch.device("cpu"))


def test_speed_bench_measures_every_encoding_and_the_llama_peer(tmp_path):
    size = speed.SIZES["tiny"]
    report = speed.run([speed.SIZES["tiny"]], [*PE_TYPES, "llama"], tmp_path, CPU, progress=False)
    entry = report["sizes"]["tiny"]
    assert list(entry["results"]) == ["rope", *(pe for pe in PE_TYPES if pe != "rope"), "llama"]
    for row, result in entry["results"].items():
        assert row == "rope" or len(result["samples"]) == len(result["rope_samples"]) == size.repeats, row
        assert result["tokens_per_s"] > 0 and result["tflops"] > 0 and result["prefill_s"] > 0, row
        assert all(
            result[f"decode_tokens_per_s_batch{b}"] > 0 and result[f"cache_bytes_batch{b}"] > 0
            for b in size.decode_batches
        ), row
        ratio = entry["ratios_to_rope"][row]["train_step_s"]
        assert ratio["n"] == size.repeats and ratio["mean"] > 0, row
    results = entry["results"]
    assert results["tape"]["cache_bytes_batch1"] > results["rope"]["cache_bytes_batch1"]
    assert results["tape"]["cache_bytes_batch2"] == 2 * results["tape"]["cache_bytes_batch1"]
    assert results["llama"]["cache_bytes_batch1"] == results["rope"]["cache_bytes_batch1"]
    assert entry["ratios_to_rope"]["rope"]["train_step_s"]["mean"] == 1.0
    for batch in size.decode_batches:  # TAPE reads more per decode step (E in its cache); Llama reads what RoPE reads
        assert entry["ratios_to_rope"]["tape"][f"decode_bytes_bound_batch{batch}"]["mean"] < 1
        assert entry["ratios_to_rope"]["llama"][f"decode_bytes_bound_batch{batch}"]["mean"] == 1
    assert "(bytes bound 0." in speed.format_table(size, entry)
    assert report["options"] == {
        "device": "cpu",
        "dtype": "float32",
        "compile": False,
        "compile_backend": "inductor",
        "fast_paths": "auto",
    }
    saved = json.loads((tmp_path / "speed-cpu-tiny.json").read_text())
    assert saved["sizes"]["tiny"]["results"]["tape"]["parameters"] == results["tape"]["parameters"]
    assert (tmp_path / "speed-cpu-tiny.png").read_bytes()[:4] == b"\x89PNG"


def test_speed_bench_trains_under_bf16_autocast_and_decodes_with_bf16_weights(tmp_path):
    report = speed.run(
        [speed.SIZES["tiny"]], ["tape"], tmp_path, speed.Options(torch.device("cpu"), bf16=True), progress=False
    )
    assert report["options"]["dtype"] == "bf16"
    results = report["sizes"]["tiny"]["results"]
    # a bf16 cache holds half the bytes of the float32 one (TAPE's cache keeps E in the model's dtype)
    float32 = speed.run([speed.SIZES["tiny"]], ["tape"], tmp_path / "f32", CPU, progress=False)["sizes"]["tiny"][
        "results"
    ]
    assert results["tape"]["cache_bytes_batch1"] * 2 == float32["tape"]["cache_bytes_batch1"]


def test_paired_decoding_times_every_token_asked_and_alternating_changes_nothing_decoded():
    """Two models decoding in alternating blocks (the last one shorter) decode what each decodes alone, and each times
    the size's tokens: one untimed step after the prompt, one before each block."""
    size = replace(speed.SIZES["tiny"], decode_tokens=2 * speed.DECODE_BLOCK + 3)
    workloads = [speed.Workload(size, row, CPU) for row in ("rope", "tape")]
    for workload in workloads:
        workload.for_decoding()
    paired = speed.paired_decoding(workloads, 2)
    for workload, decoding in zip(workloads, paired):
        alone = speed.paired_decoding([workload], 2)[0]
        assert torch.equal(decoding.token, alone.token), workload.row
        assert decoding.timed_tokens == 2 * size.decode_tokens and decoding.seconds > 0
        assert decoding.cache.get_seq_length() == size.decode_context + 1 + size.decode_tokens + 3


def test_compiled_rows_decode_with_a_static_cache_through_one_compiled_graph_per_batch(tmp_path):
    """--compile: training through compiled layers, and a decode step that really runs compiled (not under the eager
    stance that keeps compiled layers from recompiling) as one graph per decode batch on a static cache, for tapelm's
    rows and transformers' Llama; PaTH, whose cache has no fixed shapes, decodes eagerly. Dynamo's own backend here
    (the same graph capture as inductor's, no C++ build)."""
    from torch._dynamo.utils import counters

    options = speed.Options(torch.device("cpu"), compile=True, compile_backend="eager")
    size = speed.SIZES["tiny"]
    for row, compiled in (("tape", True), ("llama", True), ("path", False)):
        workload = speed.Workload(size, row, options)
        workload.train_step()
        workload.for_decoding()
        assert workload.compiles_decoding == compiled, row
        torch._dynamo.reset()
        counters.clear()
        with torch.compiler.set_stance("force_eager"):  # as bench speed decodes: compiled layers stay eager
            assert all(
                speed.paired_decoding([workload], batch)[0].tokens_per_s() > 0 for batch in size.decode_batches
            ), row
        assert counters["stats"]["unique_graphs"] == (len(size.decode_batches) if compiled else 0), row
        assert not counters["graph_break"], row
    report = speed.run([size], ["rope"], tmp_path, options, progress=False)  # RoPE alone: the one row every run has
    assert report["options"]["compile"] and report["options"]["compile_backend"] == "eager"
    assert report["sizes"]["tiny"]["results"]["rope"]["decode_tokens_per_s_batch2"] > 0


@pytest.mark.parametrize(
    "words, setting, label",
    [
        (["off"], "off", "off"),
        (["on"], "on", "on"),
        (
            ["rotation-autograd", "attention-cpu-flash"],
            ["rotation-autograd", "attention-cpu-flash"],
            "rotation-autograd, attention-cpu-flash",
        ),
    ],
)
def test_the_fast_path_setting_reaches_every_tapelm_row_and_the_record(tmp_path, words, setting, label):
    options = speed.Options(torch.device("cpu"), fast_paths=speed.fast_path_setting(words))
    for row in ("rope", "tape", "tape-mlp-only"):
        assert speed.Workload(speed.SIZES["tiny"], row, options).model.config.fast_paths == setting, row
    report = speed.run([speed.SIZES["tiny"]], ["tape"], tmp_path, options, progress=False)
    assert report["options"]["fast_paths"] == report["sizes"]["tiny"]["options"]["fast_paths"] == setting
    assert f"fast paths {label}" in speed.format_table(speed.SIZES["tiny"], report["sizes"]["tiny"])


def test_counting_the_saved_bytes_frees_what_it_counted():
    """The count of what autograd keeps leaves nothing alive: an output saved by the operation that made it (exp
    saves its result) is freed once the count is taken. Counting by keeping the tensors themselves leaked every
    graph it counted, a row's activations per row of `bench speed`."""
    x = torch.randn(64, 64, requires_grad=True)
    outputs = []

    def forward():
        y = x.exp()
        outputs.append(weakref.ref(y))
        return y.sum()

    assert speed._saved_bytes(forward) == 64 * 64 * 4
    gc.collect()
    assert outputs[0]() is None


def test_a_row_that_runs_out_of_memory_is_reported_not_raised(monkeypatch):
    original = speed.Workload.train_step

    def train_step(self):
        if self.model.config.pe_type == "cope":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 96.00 GiB")
        return original(self)

    monkeypatch.setattr(speed.Workload, "train_step", train_step)
    results = speed.measure(speed.SIZES["tiny"], ["rope", "cope", "tape"], CPU, progress=False)
    assert results["cope"] == {"error": "out of memory: CUDA out of memory. Tried to allocate 96.00 GiB"}
    assert "error" not in results["tape"]
    ratios = speed.ratios_to_rope(speed.SIZES["tiny"], results)
    table = speed.format_table(
        speed.SIZES["tiny"], {"results": results, "ratios_to_rope": ratios, "options": CPU.record()}
    )
    assert "| cope | out of memory: CUDA out of memory" in table and "cope" not in ratios


@pytest.mark.parametrize("row, encoding", [("fla-fox", "fox"), ("fla-path", "path")])
def test_fla_peer_rows_are_fla_models_of_the_same_size(row, encoding):
    """fla's own FoX and PaTH models at every size hold exactly as many parameters as tapelm's (built on meta: their
    kernels need CUDA)."""
    pytest.importorskip("fla", reason="fla is not installed (pip install tapelm[gpu])")
    for size in speed.SIZES.values():
        with torch.device("meta"):
            fla_model, tapelm_model = speed.build_model(size, row), speed.build_model(size, encoding)
        assert type(fla_model).__module__.startswith("fla.models")
        assert sum(p.numel() for p in fla_model.parameters()) == sum(p.numel() for p in tapelm_model.parameters())


def test_a_training_only_row_reports_its_training_against_ropes(monkeypatch):
    """fla's rows train only; their decoding columns stay empty and every ratio is paired with RoPE's training."""
    monkeypatch.setattr(speed, "trains_only", lambda row: row == "fox")  # a CPU row, as fla's are on CUDA
    size = speed.SIZES["tiny"]
    results = speed.measure(size, ["rope", "fox", "tape"], CPU, progress=False)
    assert "train_step_s" in results["fox"] and "prefill_s" not in results["fox"]
    assert "prefill_s" in results["rope"] and "decode_tokens_per_s_batch1" in results["tape"]
    ratios = speed.ratios_to_rope(size, results)
    assert set(ratios["fox"]) == {"train_step_s", "train_memory_bytes"}
    table = speed.format_table(size, {"results": results, "ratios_to_rope": ratios, "options": CPU.record()})
    assert "| fox |" in table and "| – | – |" in table


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "cuda"], "sees no CUDA device"),
        (["--device", "tpu"], "is not a device; use cpu, cuda or cuda:N"),
        (["--device", "mps"], "only cpu and cuda are supported"),
        (["--pe", "rotary"], "unknown row 'rotary'"),
        (["--threads", "0"], "--threads=0 is not allowed"),
        (["--repeats", "0"], "--repeats=0 is not allowed"),
        (["--pe", "fla-fox"], "row 'fla-fox' runs fla's Triton kernels: it needs a CUDA device and fla installed"),
    ],
)
def test_speed_bench_refuses_bad_input_before_any_work(tmp_path, capsys, argv, message):
    from tapelm.cli import main

    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["bench", "speed", "--sizes", "tiny", "--out", str(tmp_path / "out"), "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "words, message",
    [
        (["fast"], "fast_paths names unknown fast path(s) fast; choose one of: auto, on, off, or a list of fast path"),
        (["on", "rotation-triton"], "fast_paths names unknown fast path(s) on; choose one of"),
    ],
)
def test_speed_bench_refuses_an_unknown_fast_path_setting(tmp_path, capsys, words, message):
    from tapelm.cli import main

    assert main(["bench", "speed", "--sizes", "tiny", "--out", str(tmp_path / "out"), "--fast-paths", *words]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_doctor_runs_every_part_at_tiny_sizes_on_the_cpu(tmp_path, capsys):
    """What CI runs of the GPU visit: the law tests, bench speed, paper-preset training and cached generation."""
    from tapelm.cli import main
    from tapelm.doctor.doctor import TINY_TESTS

    assert main(["doctor", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "doctor-cpu-tiny.json").read_text())
    assert record["tiny"] and record["device"] == {"device": "cpu"}
    parts = record["parts"]
    assert {part: result["status"] for part, result in parts.items()} == dict.fromkeys(
        ("tests", "first-calls", "speed", "training", "generation"), "passed"
    )
    assert parts["tests"]["counts"] == {"passed": len(TINY_TESTS)}
    log = (tmp_path / parts["tests"]["log"]).read_text()  # pytest's whole output, the slowest tests included
    assert "slowest 20 durations" in log and f"{len(TINY_TESTS)} passed" in log.splitlines()[-1]
    assert set(parts["speed"]["sizes"]["tiny"]["results"]) == {"rope", "tape", "llama"}
    assert parts["speed"]["fast_paths"] == "on"  # the law tests, which run every fast path, passed
    for pe in ("tape", "rope"):
        assert parts["training"]["runs"][pe]["final_loss"] > 0
        assert parts["generation"]["models"][pe]["cached_equals_uncached"]


def test_a_failing_doctor_part_is_recorded_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    from tapelm.cli import main
    from tapelm.doctor import doctor

    settings = []

    def broken(device, tiny, out, fast_paths):
        settings.append(fast_paths)
        raise RuntimeError("Expected all tensors to be on the same device")

    monkeypatch.setattr(doctor, "run_speed", broken)
    assert main(["doctor", "--out", str(tmp_path), "--skip", "tests"]) == 1
    parts = json.loads((tmp_path / "doctor-cpu-tiny.json").read_text())["parts"]
    assert parts["speed"]["status"] == "failed" and "same device" in parts["speed"]["error"]
    assert parts["tests"]["status"] == "skipped" and settings == ["auto"]  # no passed tests: the verified paths
    assert parts["training"]["status"] == parts["generation"]["status"] == "passed"
    assert "doctor: failed: speed" in capsys.readouterr().err
    assert main(["doctor", "--skip", "everything"]) == 2
