#!/usr/bin/env bash
# A GPU visit in one command: what the issue "TAPE at nearly RoPE's cost" and the CUDA fast paths wait for. Not yet
# run on a GPU (no session has been lent one since it was written).
#
# Here, once, in the repository root (the GPU machine reaches no package registry):
#   echo /.whl/ >> .git/info/exclude && bash docs/gpu/visit.sh prepare
# fetches into .whl/ the wheels tapelm needs beyond the GPU image's packages (its torch, Triton, accelerate, peft,
# huggingface_hub and tokenizers stay). There, as the device tool's one command, carrying .whl, within its limit:
#   bash docs/gpu/visit.sh run "$OUT"
# writes under OUT: tapelm doctor's JSON (the law tests on the GPU, which run every fast path on; bench speed for
# RoPE, TAPE and Llama at the GPU sizes, with every fast path on when those tests passed; a paper-preset training;
# cached generation), bench speed of TAPE with compile_layers() and the compiled decode step at 1,024 x 16, and the
# logs. Commit what comes back under docs/gpu/ with the device named, and move each fast path whose tests passed
# into `tapelm.fast_paths.VERIFIED`.
set -uo pipefail
cd "$(dirname "$0")/../.."
wheels=(transformers==5.24.0 flash-linear-attention==0.6.0 fla-core==0.6.0 parameterized==0.9.0 dill==0.4.1
        "regex>=2025.10.22")
case "${1:-}" in
  prepare)
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl "${wheels[@]}"
    ;;
  run)
    out=${2:?usage: visit.sh run OUT_DIR}
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
    status=0
    timeout 400 python3 -m tapelm.cli doctor --out "$out" 2>&1 | tee "$out/doctor.log" || status=1
    timeout 150 python3 -m tapelm.cli bench speed --device cuda --dtype bf16 --compile --fast-paths on \
      --sizes paper-1k --pe tape --repeats 3 --no-progress --out "$out" 2>&1 | tee "$out/compiled.log" || status=1
    exit $status
    ;;
  *)
    echo "usage: visit.sh prepare | run OUT_DIR" >&2
    exit 2
    ;;
esac
