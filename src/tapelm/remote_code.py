"""Saved model folders that load without importing tapelm first.

transformers only knows model type "tape" once tapelm is imported. So every folder a `TapeConfig` is saved to (and
so every `save_pretrained` of a model) also gets two one-line modules that import tapelm's classes, and config.json
an `auto_map` naming them: a client with tapelm installed loads the folder with `AutoConfig` /
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` (e.g. `lm_eval --model hf --model_args
pretrained=FOLDER,trust_remote_code=True`), and gets tapelm's own classes, not a copy of their code.
"""

from __future__ import annotations

from pathlib import Path

AUTO_MAP = {
    "AutoConfig": "configuration_tape.TapeConfig",
    "AutoModel": "modeling_tape.TapeModel",
    "AutoModelForCausalLM": "modeling_tape.TapeForCausalLM",
}
_HEADER = '"""tapelm\'s {what}, for transformers\' trust_remote_code: the tapelm package must be installed."""\n\n'
MODULES = {
    "configuration_tape.py": _HEADER.format(what="TapeConfig") + "from tapelm import TapeConfig\n\n"
    '__all__ = ["TapeConfig"]\n',
    "modeling_tape.py": _HEADER.format(what="models") + "from tapelm import TapeForCausalLM, TapeModel\n\n"
    '__all__ = ["TapeModel", "TapeForCausalLM"]\n',
}


def write_modules(directory: str | Path) -> None:
    """Write the modules `AUTO_MAP` names into `directory`."""
    for name, text in MODULES.items():
        (Path(directory) / name).write_text(text)


__all__ = ["AUTO_MAP", "MODULES", "write_modules"]
