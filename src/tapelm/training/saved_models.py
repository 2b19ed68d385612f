"""A run's final model: written whole through a temporary folder and a rename, and read back with a clear error."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def save_model(accelerator, model, directory: Path) -> None:
    unwrapped = accelerator.unwrap_model(model)
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        temporary = directory.with_name("." + directory.name + ".tmp")
        if temporary.exists():
            shutil.rmtree(temporary)
        if hasattr(unwrapped, "save_pretrained"):
            from transformers.utils import logging as hf_logging

            shown = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()  # one shard: its bar is noise in the run's output
            try:
                unwrapped.save_pretrained(str(temporary), state_dict=state, safe_serialization=True)
            finally:
                if shown:
                    hf_logging.enable_progress_bar()
        else:
            from safetensors.torch import save_file

            temporary.mkdir(parents=True)
            save_file({k: v.contiguous() for k, v in state.items()}, str(temporary / "model.safetensors"))
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(temporary, directory)
    accelerator.wait_for_everyone()


def load_saved_model(directory: Path, model_class, **kwargs):
    """`model_class.from_pretrained(directory, **kwargs)`; ValueError naming the folder when its files cannot be
    read (a copy cut short, a disk that filled up).

    Hub kernels stay off unless asked for (`use_kernels=True`): from transformers 5.25 `from_pretrained` turns them on
    by default, fetching layer code at run time and re-kernelizing at every `train()` / `eval()` (which fails on the
    meta device). A model a command loads computes what its own code says: tapelm's fast paths are its config's, and a
    pretrained source is the reference a conversion is checked against."""
    kwargs.setdefault("use_kernels", False)
    try:
        return model_class.from_pretrained(str(directory), **kwargs)
    except Exception as error:  # safetensors, json and torch each raise their own kinds
        reason = (str(error).strip().splitlines() or [""])[0][:200]
        raise ValueError(
            f"the model in '{directory}' cannot be read ({type(error).__name__}: {reason}); it is "
            "truncated or corrupt: write it again (rerun or resume the command that made it)"
        ) from None
