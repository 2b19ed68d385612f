"""Where tapelm keeps what it fetches once (pretrained checkpoints, corpora): `cache_root`."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$TAPELM_CACHE``, else ``$XDG_CACHE_HOME/tapelm``, else ``~/.cache/tapelm``."""
    if env := os.environ.get("TAPELM_CACHE"):
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "tapelm"
