"""The model library on its own (CI's bare stage, in a venv with `pip install tapelm` alone): every registered encoding
builds, trains one step, generates with a cache, and saves and loads through the Auto classes; no module of the lab
and no package of the lab's extra is imported; the lab's commands name the extra to install, and `check-encoding`
runs. Exits non-zero, naming what failed."""

from __future__ import annotations

import subprocess
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM

import tapelm
from tapelm import TapeForCausalLM
from tapelm.positional import encoding_names
from tapelm.testing import tiny_config

LAB_PARTS = ("analysis", "bench", "data", "doctor", "experiments", "pretrained", "report", "scrolls", "training")
LAB_PACKAGES = ("accelerate", "peft", "matplotlib", "scipy", "datasets", "rouge_score", "gguf")


def exercise(name: str, folder: str) -> None:
    """Build, one training step, cached generation, save and load through the Auto classes (equal logits)."""
    torch.manual_seed(0)
    model = TapeForCausalLM(tiny_config(name))
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    model.eval()
    generated = model.generate(ids[:, :4], max_new_tokens=6, do_sample=False)
    assert generated.shape == (2, 10), (name, generated.shape)
    model.save_pretrained(folder)
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits), f"{name}: logits differ after a round trip"


def command(*words: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tapelm.cli", *words], capture_output=True, text=True)


def main() -> None:
    names = encoding_names()
    for name in names:
        with tempfile.TemporaryDirectory() as folder:
            exercise(name, folder)
    imported = sorted(m for m in sys.modules if m.split(".")[:2] in ([tapelm.__name__, part] for part in LAB_PARTS))
    packages = sorted(p for p in LAB_PACKAGES if p in sys.modules)
    assert not imported and not packages, f"the model library imported the lab: {imported + packages}"
    lab = command("compare", "mqar")
    assert lab.returncode == 2 and "pip install 'tapelm[lab]'" in lab.stderr, (lab.returncode, lab.stderr)
    kit = command("check-encoding", "rope", "--law", "causal", "cache_step", "save_load")
    assert kit.returncode == 0, kit.stdout + kit.stderr
    print(f"bare: {len(names)} encodings built, trained a step, generated, saved and loaded; no lab imported")
    print(f"bare: `tapelm compare` says: {lab.stderr.strip()}")


if __name__ == "__main__":
    main()
