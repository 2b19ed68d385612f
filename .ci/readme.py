"""Print one of the README's two opening commands, as written: `first` (the set-up and the main job) or `tests`.

.ci/run runs them from here, so CI runs exactly what a newcomer copies from the README."""

import re
import sys
from pathlib import Path

readme = Path(__file__).resolve().parents[1] / "README.md"
block = re.search(r"```bash\n(.*?)```", readme.read_text(), re.S)
lines = block.group(1).strip().splitlines() if block else []
if len(lines) != 2 or sys.argv[1:] not in (["first"], ["tests"]):
    sys.exit("usage: readme.py first|tests (the README's first ```bash block must hold exactly two lines)")
print(lines[0] if sys.argv[1] == "first" else lines[1])
