#!/usr/bin/env bash
# Tokens/s of the cpu-small addition run before and after the speed work of the issue "Comparisons that learn",
# measured side by side: the code as it was when the issue was filed (commit 0c760f0) and the working tree (eager,
# and with --compile), each running `tapelm train` with the settings that commit's preset used (TAPE, 4 heads,
# 600 steps x 64, lr 3e-3, 20 problems per evaluation cell, one thread), taking turns, one run alive at a time.
# Run it on a quiet machine.
#
#   bash docs/speed/before-after.sh [REPEATS] [OUT_JSON]
#
# Writes OUT_JSON (default docs/speed/before-after-cpu-small-addition.json): per run the training tokens/s (real
# tokens over training seconds, from each run's result.json; compiling counts as training time), the steady rate
# (median of the rates logged over the second half of the steps, from metrics.jsonl) and the whole run's seconds,
# and each side's medians over the "before" side's.
set -euo pipefail
repeats=${1:-3}
out=${2:-docs/speed/before-after-cpu-small-addition.json}
before_commit=0c760f0
root=$(git rev-parse --show-toplevel)
python=${PYTHON:-$root/.venv/bin/python}
work=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$work/before" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git -C "$root" worktree add --detach "$work/before" "$before_commit" >/dev/null

settings=(--task addition --pe tape --seed 0 --steps 600 --lr 3e-3 --warmup 50 --batch-size 64 --log-every 10
          --eval-n 20 --threads 1 --no-progress)
for repeat in $(seq 1 "$repeats"); do
  for side in before after after-compiled; do
    src=$root/src
    extra=(--model-option num_attention_heads=4 --model-option num_key_value_heads=4 --eval-every 0)
    if [ "$side" = before ]; then src=$work/before/src; extra=(); fi
    if [ "$side" = after-compiled ]; then extra+=(--compile); fi
    echo "repeat $repeat/$repeats: $side" >&2
    (cd "$work" && OMP_NUM_THREADS=1 PYTHONPATH=$src "$python" -c 'import sys; from tapelm.cli import main; sys.exit(main())' \
      train "${settings[@]}" "${extra[@]}" --out "$work/runs/$side-$repeat" >/dev/null)
  done
done

"$python" - "$work/runs" "$repeats" "$before_commit" "$(git -C "$root" rev-parse --short HEAD)" "$out" <<'EOF'
import json, statistics, sys
from pathlib import Path

from tapelm.training.provenance import environment

runs, repeats, before_commit, after_commit, out = Path(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:]
report = {"command": "bash docs/speed/before-after.sh " + str(repeats), "task": "addition", "pe": "tape",
          "steps": 600, "steady_from_step": 300,
          "settings": "cpu-small at commit " + before_commit + ": 4 layers, hidden 128, 4 heads, 600 steps x 64, "
                      "lr 3e-3, eval 20 problems per cell, one thread",
          "before_commit": before_commit, "after_commit": after_commit, "environment": environment(), "sides": {}}
for side in ("before", "after", "after-compiled"):
    rows = []
    for repeat in range(1, repeats + 1):
        result = json.loads((runs / f"{side}-{repeat}" / "result.json").read_text())
        logged = [json.loads(line) for line in (runs / f"{side}-{repeat}" / "metrics.jsonl").read_text().splitlines()]
        late = [m["tokens_per_s"] for m in logged if "tokens_per_s" in m and m["step"] > 300]
        rows.append({"train_tokens_per_s": result["tokens_this_session"] / result["train_seconds_this_session"],
                     "steady_tokens_per_s": statistics.median(late),
                     "train_seconds": result["train_seconds_this_session"], "run_seconds": result["session_seconds"],
                     "tokens": result["tokens_this_session"], "final_loss": result["final_loss"]})
    report["sides"][side] = {"runs": rows,
                             "median_train_tokens_per_s": statistics.median(r["train_tokens_per_s"] for r in rows),
                             "median_steady_tokens_per_s": statistics.median(r["steady_tokens_per_s"] for r in rows),
                             "median_run_seconds": statistics.median(r["run_seconds"] for r in rows)}
before = report["sides"]["before"]
for side, entry in report["sides"].items():
    entry["train_tokens_per_s_ratio"] = entry["median_train_tokens_per_s"] / before["median_train_tokens_per_s"]
    entry["steady_tokens_per_s_ratio"] = entry["median_steady_tokens_per_s"] / before["median_steady_tokens_per_s"]
    entry["run_speed_ratio"] = before["median_run_seconds"] / entry["median_run_seconds"]
    print(f"{side}: training {entry['median_train_tokens_per_s']:,.0f} tokens/s "
          f"({entry['train_tokens_per_s_ratio']:.2f}x), steady {entry['median_steady_tokens_per_s']:,.0f} "
          f"({entry['steady_tokens_per_s_ratio']:.2f}x), whole run {entry['median_run_seconds']:.0f} s "
          f"({entry['run_speed_ratio']:.2f}x as fast)")
Path(out).write_text(json.dumps(report, indent=2) + "\n")
print(f"wrote {out}")
EOF
