"""Files written whole or not at all: through a temporary file and a rename, so readers never see half a file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json_atomically(path: Path, payload: Any) -> None:
    """Write JSON through a temporary file and a rename: readers never see half a file."""
    write_text_atomically(path, json.dumps(payload, indent=2))


def write_text_atomically(path: Path, text: str) -> None:
    """Write text through a temporary file and a rename."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
