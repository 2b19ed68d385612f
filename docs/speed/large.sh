#!/usr/bin/env bash
# bench speed's large size (12 layers x 768, 1,024 tokens) for every encoding and Llama, one process per row (each
# beside RoPE, one repetition), so that each row's peak memory is its own: a single process measuring every row in
# turn was killed at 24 GB (before the memory count stopped leaking its graphs; not rerun since). Writes
# docs/speed/large/ROW/speed-cpu-large.json per row and, beside it, the process's peak resident memory in kB
# (peak-rss-kb.txt, from /usr/bin/time).
#
#   bash docs/speed/large.sh [ROW ...]    measure (default: every encoding and Llama), then print the table
#   bash docs/speed/large.sh --table      only print the table of ratios to RoPE from the JSON already written
set -uo pipefail
root=$(git rev-parse --show-toplevel)
tapelm=${TAPELM:-$root/.venv/bin/tapelm}
python=${PYTHON:-$root/.venv/bin/python}

table() {
    "$python" - "$root/docs/speed/large" <<'PY'
import json, pathlib, sys
root = pathlib.Path(sys.argv[1])
keys = ("train_step_s", "train_memory_bytes", "prefill_s", "decode_tokens_per_s_batch1", "decode_tokens_per_s_batch8")
print("| row | train step | training memory | prefill | decode b1 | decode b8 | peak RSS (GB) |")
print("|---|---:|---:|---:|---:|---:|---:|")
for folder in sorted(path for path in root.iterdir() if (path / "speed-cpu-large.json").exists()):
    entry = json.loads((folder / "speed-cpu-large.json").read_text())["sizes"]["large"]
    ratios = entry["ratios_to_rope"].get(folder.name)
    if ratios is None:
        print(f"| {folder.name} | {entry['results'][folder.name].get('error', 'no result')} |")
        continue
    peak = int((folder / "peak-rss-kb.txt").read_text().split()[-1]) / 2**20
    cells = " | ".join(f"{ratios[key]['mean']:.2f}x" if key in ratios else "-" for key in keys)
    print(f"| {folder.name} | {cells} | {peak:.1f} |")
PY
}

if [ "${1:-}" = "--table" ]; then
    table
    exit
fi
rows=("$@")
[ ${#rows[@]} -gt 0 ] || rows=(tape randpe xpos nope alibi t5 fire cope sinusoidal learned fox path llama)
status=0
cd "$root"
for row in "${rows[@]}"; do
    out=docs/speed/large/$row
    mkdir -p "$out"
    if /usr/bin/time -f %M -o "$out/peak-rss-kb.txt" "$tapelm" bench speed --sizes large --repeats 1 --pe "$row" \
            --no-progress --out "$out" > "$out/table.md" 2>&1; then
        echo "$row: done, peak RSS $(cat "$out/peak-rss-kb.txt") kB"
    else
        echo "$row: FAILED (see $out/table.md)"
        status=1
    fi
done
table
exit $status
