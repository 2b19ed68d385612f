"""Fine-tuning a converted model: trainable sets by module type, S²-Attn, a falling loss, merged round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import tapelm  # noqa: F401  (registers the Auto classes)
from tapelm import TapeForCausalLM
from tapelm.kernels.attention import explicit_attention
from tapelm.pretrained.finetune import METHODS, FinetuneSettings, build_model, finetune, prepare, scale_factor
from tapelm.pretrained.longlora import attention_function, s2_attention, s2_reference_mask, shifted_sparse_attention

HIDDEN, HEADS, KV_HEADS, LAYERS, VOCAB, INTER = 32, 4, 2, 2, 61, 48
HEAD_DIM = HIDDEN // HEADS


def tiny_llama(tied: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).eval()


def settings(method: str, **overrides) -> FinetuneSettings:
    options = dict(
        method=method,
        train_length=32,
        steps=12,
        lr=1e-2,
        warmup=0,
        target_length=256,
        pretrained_length=128,
        checkpoint_every=0,
        lora=method != "full",
    )
    options.update(overrides)
    return FinetuneSettings(**options)


# Expected trainable counts, from the sizes alone.
LORA = LAYERS * 8 * (2 * (HIDDEN + HEADS * HEAD_DIM) + 2 * (HIDDEN + KV_HEADS * HEAD_DIM))  # r (in + out) per proj
NORMS = (2 * LAYERS + 1) * HIDDEN
EMBEDDINGS = VOCAB * HIDDEN
POSITION = 4 * HEADS
TAPE = (LAYERS - 1) * (KV_HEADS * HEADS + HIDDEN * POSITION + 2 * POSITION * KV_HEADS)  # last layer has none


@pytest.mark.parametrize(
    "method,overrides,expected",
    [
        ("tape", {}, {"tape": TAPE, "lora": LORA, "norms": NORMS, "embeddings": EMBEDDINGS}),
        ("tape", {"lora": False, "train_embeddings": False, "train_norms": False}, {"tape": TAPE}),
        ("lora", {}, {"lora": LORA, "norms": NORMS, "embeddings": EMBEDDINGS}),
        ("longlora", {}, {"lora": LORA, "norms": NORMS, "embeddings": EMBEDDINGS}),
        ("theta", {"train_embeddings": False}, {"lora": LORA, "norms": NORMS}),
        ("pi", {}, {"lora": LORA, "norms": NORMS, "embeddings": EMBEDDINGS}),
        ("yarn", {}, {"lora": LORA, "norms": NORMS, "embeddings": EMBEDDINGS}),
        (
            "full",
            {},
            {
                "all": EMBEDDINGS
                + NORMS
                + LAYERS * (2 * HIDDEN * HEADS * HEAD_DIM + 2 * HIDDEN * KV_HEADS * HEAD_DIM + 3 * HIDDEN * INTER)
            },
        ),
    ],
)
def test_trainable_parameters_per_method(method, overrides, expected):
    config = settings(method, **overrides)
    base = build_model(tiny_llama(), config)
    tape_ids = {id(p) for p in base.tape_parameters()}
    model, groups = prepare(base, config)
    assert {k: sum(p.numel() for p in v) for k, v in groups.items()} == expected
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == sum(expected.values())
    if "tape" in groups:
        assert {id(p) for p in groups["tape"]} == tape_ids
    else:
        assert not tape_ids


def test_methods_set_their_positions():
    source = tiny_llama()
    assert build_model(source, settings("tape")).config.pe_type == "tape"
    assert build_model(source, settings("lora")).config.pe_type == "rope"
    assert build_model(source, settings("theta", theta=1e6)).config.rope_parameters["rope_theta"] == 1e6
    pi = build_model(source, settings("pi", target_length=512, pretrained_length=128)).config.rope_parameters
    assert pi["rope_type"] == "linear" and pi["factor"] == 4.0
    yarn = build_model(source, settings("yarn", target_length=512, pretrained_length=128)).config.rope_parameters
    assert (yarn["rope_type"], yarn["factor"], yarn["original_max_position_embeddings"]) == ("yarn", 4.0, 128)
    yarn_from_config = build_model(source, settings("yarn", target_length=512, pretrained_length=None))
    assert yarn_from_config.config.rope_parameters["factor"] == 4.0  # the source's window, 128, from its config
    with pytest.raises(ValueError, match="would be the identity"):
        scale_factor(settings("pi", target_length=64, pretrained_length=None), 128)
    with pytest.raises(ValueError, match="method='x' is not allowed"):
        FinetuneSettings(method="x")
    with pytest.raises(ValueError, match="lora=False is only for method 'tape'"):
        FinetuneSettings(method="lora", lora=False)
    longlora = build_model(source, settings("longlora", interpolate_positions=True)).config.rope_parameters
    assert (longlora["rope_type"], longlora["factor"]) == ("linear", 2.0)
    assert build_model(source, settings("longlora")).config.rope_parameters.get("rope_type", "default") == "default"
    with pytest.raises(ValueError, match="interpolate_positions is for method 'longlora'"):
        settings("lora", interpolate_positions=True)
    with pytest.raises(ValueError, match="method 'full' trains every weight"):
        FinetuneSettings(method="full")
    with pytest.raises(ValueError, match="s2_group_fraction=0.3 of train_length=32"):
        settings("longlora", s2_group_fraction=0.3)


@pytest.mark.parametrize("length,group", [(32, 8), (24, 8), (8, 8)])
def test_s2_attention_is_grouped_causal_attention_with_half_the_heads_shifted(length, group):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, length, 8, generator=generator, dtype=torch.float64)
    k = torch.randn(2, 3, length, 8, generator=generator, dtype=torch.float64)
    v = torch.randn(2, 3, length, 8, generator=generator, dtype=torch.float64)
    expected = explicit_attention(q, k, v, s2_reference_mask(6, length, group), False, 0.3)[0]
    torch.testing.assert_close(s2_attention(q, k, v, group, 0.3), expected)
    mask = s2_reference_mask(6, length, group)[0]
    if length > group:  # unshifted heads never see the previous group; shifted heads straddle it
        assert not mask[0, group, group - 1] and mask[-1, group, group - 1]
    assert not (mask & ~torch.ones(length, length, dtype=torch.bool).tril()).any()


def test_s2_attention_refuses_what_it_is_not_for_and_is_restored():
    attend = attention_function(8)
    q = torch.zeros(1, 2, 16, 4)
    with pytest.raises(ValueError, match="S²-Attn"):
        attend(torch.nn.Module().train(), q, q, q, torch.ones(1, 1, 16, 16, dtype=torch.bool), 0.5, is_causal=False)
    model = build_model(tiny_llama(), settings("longlora"))
    before = model.config._attn_implementation
    with shifted_sparse_attention(model, 8):
        assert model.config._attn_implementation == "tapelm_s2_attention_8"
    assert model.config._attn_implementation == before


def cycle_stream(length: int = 32):
    pattern = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(3))

    def stream(index: int) -> dict[str, torch.Tensor]:
        ids = pattern.roll(index % 8).repeat(length // 8)[None]
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}

    return stream


@pytest.mark.parametrize("method", ["tape", "longlora"])
def test_finetune_lowers_the_loss_and_round_trips_merged(method, tmp_path: Path):
    source = tiny_llama()
    result = finetune(source, None, settings(method), tmp_path / method, batch_stream=cycle_stream(), progress=False)
    assert result.losses[-1] < 0.5 * result.losses[0]
    model = result.model
    assert type(model) is TapeForCausalLM  # LoRA merged away
    if method == "tape":
        assert any(p.abs().sum() > 0 for name, p in model.named_parameters() if "mix_up" in name)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / method / "merged").eval()
    tokens = cycle_stream()(0)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, model(tokens).logits, atol=1e-5, rtol=0)
        assert not torch.allclose(model(tokens).logits, source(tokens).logits, atol=1e-2)


def test_every_method_trains(tmp_path: Path):
    source = tiny_llama(tied=False)
    for method in METHODS:
        result = finetune(
            source, None, settings(method, steps=3), tmp_path / method, batch_stream=cycle_stream(), progress=False
        )
        assert len(result.losses) == 3 and all(torch.isfinite(torch.tensor(result.losses)))


def fake_result(name: str, ppl: float, trained: bool) -> dict:
    record = {
        "name": name,
        "eval_plan": {"lengths": [128, 256], "passkey_lengths": [256], "scored": 256, "documents": 1, "trials": 20},
        "eval": {
            "perplexity": {c: {"128": {"perplexity": ppl}, "256": {"perplexity": ppl - 1}} for c in ("code", "prose")},
            "passkey": {"256": {"accuracy": 0.95}},
        },
    }
    if trained:
        record.update(
            settings=FinetuneSettings(method=name).to_dict() | {"target_length": 512, "pretrained_length": 128},
            trainable={"lora": 10},
            train={"seconds_per_step": 2.0, "losses": [3.0, 2.0]},
        )
    return record


def test_results_section_is_spliced_into_the_report_and_rebuilt_in_place(tmp_path: Path):
    import json

    from tapelm.pretrained.retrofit import update_markdown
    from tapelm.report import build_report

    results = tmp_path / "docs" / "results" / "pretrained"
    results.mkdir(parents=True)
    for name, ppl, trained in (("original", 5.0, False), ("tape", 4.5, True)):
        (results / f"{name}.json").write_text(json.dumps(fake_result(name, ppl, trained)))
    markdown = tmp_path / "docs" / "RESULTS.md"
    markdown.write_text("# Results\n\nkept text\n")
    update_markdown(markdown, results)
    first = markdown.read_text()
    assert "kept text" in first and "| tape | 4.500 | 3.500 | 4.500 | 3.500 |" in first
    assert (
        "| original | 0.95 |" in first
        and "Missing from this run: lora, longlora, theta, pi, yarn, full, converted." in first
    )
    assert "identical for every method" in first
    update_markdown(markdown, results)
    assert markdown.read_text() == first
    (tmp_path / "runs").mkdir()
    build_report(tmp_path / "runs", markdown, sections=["pretrained-model"])
    assert markdown.read_text() == first


def test_the_decoder_really_computes_s2_attention_inside_the_block_only_while_training():
    model = build_model(tiny_llama(), settings("longlora"))
    tokens = cycle_stream(32)(0)["input_ids"]
    with torch.no_grad():
        full = model(tokens, use_cache=False).logits
        with shifted_sparse_attention(model, 8):
            evaluated = model(tokens, use_cache=False).logits  # eval mode: an evaluation while training
            sparse = model.train()(tokens, use_cache=False).logits
            model.eval()
        again = model(tokens, use_cache=False).logits
    torch.testing.assert_close(evaluated, full, atol=0, rtol=0)
    torch.testing.assert_close(sparse[:, :4], full[:, :4], atol=1e-5, rtol=0)  # a first half-group sees all keys
    assert not torch.allclose(sparse[:, 16:], full[:, 16:], atol=1e-4)
    torch.testing.assert_close(again, full, atol=0, rtol=0)


def test_s2_attention_is_per_model_two_models_in_one_process_differ():
    """One model computes S²-Attn while a copy of it, alive at the same time, keeps full attention."""
    sparse_model = build_model(tiny_llama(), settings("longlora"))
    full_model = build_model(tiny_llama(), settings("longlora"))
    full_model.load_state_dict(sparse_model.state_dict())
    tokens = cycle_stream(32)(0)["input_ids"]
    with torch.no_grad():
        reference = full_model(tokens, use_cache=False).logits
        with shifted_sparse_attention(sparse_model, 8):
            sparse = sparse_model.train()(tokens, use_cache=False).logits
            full = full_model(tokens, use_cache=False).logits
    torch.testing.assert_close(full, reference, atol=0, rtol=0)
    assert not torch.allclose(sparse[:, 16:], full[:, 16:], atol=1e-4)


# ------------------------------------------------------------------------------------------ the `finetune` command

PROSE = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire. " * 40


def llama_folder(folder: Path, seed: int) -> str:
    """A tiny Llama checkpoint with its own small BPE tokenizer, as `tapelm finetune --model FOLDER` loads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator([PROSE, "def f(x):\n    return x\n"], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=backend.get_vocab_size(),
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def finetune_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune-cli")
    prose = root / "prose"
    prose.mkdir()
    for index in range(3):
        (prose / f"page{index}.txt").write_text(PROSE)
    return {
        "llama": llama_folder(root / "llama", 0),
        "mistral": llama_folder(root / "mistral", 1),
        "prose": str(prose),
        "root": root,
    }


def finetune_cli(inputs, out: Path, *extra: str, model: str = "llama") -> list[str]:
    return [
        "finetune",
        "--model",
        inputs[model],
        "--method",
        "lora",
        "--out",
        str(out),
        "--train-length",
        "32",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--no-eval",
        "--prose-corpus",
        inputs["prose"],
        *extra,
    ]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--lr", "-1"], "lr=-1.0 is not allowed; it must be a positive number"),
        (["--lr", "50"], "lr=50.0 is not allowed; it must be a number in [0.0, 10.0]"),
        (["--method", "pi", "--target-length", "64"], "target_length=64 does not exceed the pretrained context 128"),
        (["--eval-lengths", "0"], "eval lengths [0] are not allowed; give one or more integers >= 2"),
        (["--eval-lengths", "100"], "eval length 100 is not allowed: its stride min(256, 100 // 2) = 50 must divide"),
        (["--threads", "-1"], "--threads=-1 is not allowed; it must be a positive integer"),
        (["--out", "FILE"], "--out 'FILE' is a file; give a folder"),
        (["--prose-corpus", "/no/such/prose"], "--prose-corpus '/no/such/prose' does not exist"),
    ],
)
def test_finetune_refuses_bad_input_in_one_line_before_any_work(finetune_inputs, tmp_path, capsys, extra, message):
    from tapelm.cli import main

    (tmp_path / "FILE").write_text("not a folder")
    extra = [str(tmp_path / "FILE") if a == "FILE" else a for a in extra]
    message = message.replace("FILE", str(tmp_path / "FILE"))
    assert main([*finetune_cli(finetune_inputs, tmp_path / "out"), *extra]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and message in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]


def test_finetune_without_the_default_prose_corpus_names_the_option(finetune_inputs, tmp_path, capsys, monkeypatch):
    from tapelm.cli import main

    monkeypatch.setenv("TAPELM_CACHE", str(tmp_path / "cache"))  # python3.11-doc not fetched here ...
    monkeypatch.setenv("PATH", str(tmp_path))  # ... and no apt-get to fetch it
    argv = finetune_cli(finetune_inputs, tmp_path / "out")
    assert main(argv[: argv.index("--prose-corpus")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "apt-get / dpkg-deb are not available" in error and "--prose-corpus" in error
    assert not (tmp_path / "out").exists()


def test_a_failing_method_makes_finetune_exit_nonzero(finetune_inputs, tmp_path, capsys):
    from tapelm.cli import main

    tiny = tmp_path / "tiny-prose"
    tiny.mkdir()
    for index in range(2):
        (tiny / f"page{index}.txt").write_text("Too short.")
    argv = finetune_cli(finetune_inputs, tmp_path / "out")
    argv[argv.index("--prose-corpus") + 1] = str(tiny)  # a training stream shorter than one window: training fails
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "lora: FAILED" in captured.out and "fewer than length=32" in captured.out
    assert "1 of 1 models failed (lora)" in captured.err
    assert not (tmp_path / "out" / "results" / "lora.json").exists()


def test_results_and_runs_are_keyed_by_the_source_model(finetune_inputs, tmp_path, capsys):
    """A second model in the same --out is refused, never reported with (or resumed from) the first model's run."""
    from tapelm.cli import main

    out = tmp_path / "out"
    assert main(finetune_cli(finetune_inputs, out)) == 0
    record = json.loads((out / "results" / "lora.json").read_text())
    assert record["model"] == finetune_inputs["llama"]
    assert json.loads((out / "lora" / "finetune.json").read_text())["source"] == finetune_inputs["llama"]
    before = (out / "lora" / "merged" / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert main(finetune_cli(finetune_inputs, out, model="mistral")) == 2
    error = capsys.readouterr().err
    assert "holds results of another configuration (different source model" in error
    assert main(finetune_cli(finetune_inputs, out, "--results", str(tmp_path / "other"), model="mistral")) == 2
    assert (
        f"holds a fine-tuning of {finetune_inputs['llama']}, not of {finetune_inputs['mistral']}"
        in capsys.readouterr().err
    )
    assert main(finetune_cli(finetune_inputs, out, "--steps", "2")) == 2  # other settings: refused too
    assert "different fine-tuning settings" in capsys.readouterr().err
    assert (out / "lora" / "merged" / "model.safetensors").read_bytes() == before
    assert main(finetune_cli(finetune_inputs, out)) == 0  # the same command again: the cached result
    assert "lora: done before" in capsys.readouterr().out
