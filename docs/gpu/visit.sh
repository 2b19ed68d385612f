#!/usr/bin/env bash
# A GPU visit in stages that fit the device tool's limits (15 minutes of device time a session, 10 a command, 8 files
# back): what the issue "TAPE at nearly RoPE's cost" and the CUDA fast paths wait for.
#
# Here, once, in the repository root (the GPU machine reaches no package registry):
#   echo /.whl/ >> .git/info/exclude && bash docs/gpu/visit.sh prepare
# fetches into .whl/ the wheels tapelm needs beyond the GPU image's packages (its torch, Triton, accelerate, peft,
# huggingface_hub and tokenizers stay). There, as the device tool's command, carrying .whl:
#   bash docs/gpu/visit.sh run "$OUT" SECONDS STAGE...
# runs the stages in order, each only while it fits in SECONDS (each stage's own limit is below), and after each one
# packs everything it wrote into OUT/visit.tgz (the logs and JSON; unpack it under docs/gpu/<device>/). The stages
# after `tests` run with the fast paths the tests earned (on when they passed), the others with VISIT_FAST_PATHS
# (auto, on or off; default auto). VISIT_TESTS (a pytest -k expression) and VISIT_WORKERS (default 8) shape the tests.
# Stages:
#   tests        tapelm doctor's law tests on the GPU (`pytest --device cuda -m device`, every fast path on), on 8
#                pytest workers, each test named in the log as it ends; it takes what is left of SECONDS, up to
#                VISIT_TESTS_SECONDS (default 480) so that later stages keep their time, and runs only if 150 s are left
#   eager-1k     bench speed, 12 x 768 at 1,024 x 16, bf16 autocast: RoPE, TAPE and transformers' Llama
#   reference-1k the same, RoPE and TAPE, every fast path off (the plain PyTorch paths: what the fast paths give)
#   fast-1k      the same, RoPE and TAPE, every fast path on whether or not the tests passed (a measurement of the
#                paths not yet verified)
#   compiled-1k  the same with --compile (compiled layers; a static cache and a compiled decode step), RoPE and TAPE
#   paths-1k     docs/gpu/fast_path_ablation.py at 1,024 x 16: RoPE's and TAPE's training step and eager batch-1
#                decoding with no fast path, each CUDA fast path alone, and all, 4 repetitions
#   profile-1k   docs/gpu/profile_steps.py at 1,024 x 16: torch.profiler's kernels of RoPE's and TAPE's eager
#                training step and compiled batch-1 decoding step (without CUDA graphs, each kernel seen)
#   eager-4k     bench speed at 4,096 x 4, RoPE and TAPE
#   gqa-2k       bench speed of the 24 x 1,024 GQA model at 2,048 x 8, RoPE and TAPE
# Commit what comes back under docs/gpu/ with the device named, and move each fast path whose tests passed into
# `tapelm.fast_paths.VERIFIED`.
#
# Seen on an H100 (2026-11-26, docs/gpu/h100-2026-11-26/ and -b/): a machine started in about 30 s; eager-1k took
# 88 s, eager-4k 35-52 s, gqa-2k 52 s, compiled-1k about 200 s (mostly compiling); with the fast paths on, fla
# autotunes each kernel inside the first stage that reaches it (fast-1k did not finish in 110 s, hence its 240 s).
# The law tests took 265 s on 8 workers while every worker autotuned fla's kernels (16 workers were slower still);
# the conftest now compiles one configuration per autotuned kernel under --device cuda.
# Third visit (2026-11-27, docs/gpu/h100-2026-11-27/): the tests took 161 s, compiled-1k 232 s, fast-1k 163 s, and
# eager-4k with every fast path on ran past 70 s (fla autotuning at the new size), hence the limits below. Within 900 s
# of device time, a first call `VISIT_TESTS_SECONDS=200 run "$OUT" 590 tests paths-1k fast-1k` runs the tests and
# paths-1k, which says which fast path costs what at 1k (all of them together were slower there than none), and
# fast-1k only if the tests end early; a second call on the warm machine, `run "$OUT" 240 profile-1k`, if time is
# left (compiled-1k needs 270 s more).
set -uo pipefail
cd "$(dirname "$0")/../.."
wheels=(transformers==5.24.0 flash-linear-attention==0.6.0 fla-core==0.6.0 parameterized==0.9.0 dill==0.4.1
        "regex>=2025.10.22")
declare -A limit=([tests]=150 [eager-1k]=120 [reference-1k]=70 [fast-1k]=200 [compiled-1k]=270 [eager-4k]=150
                  [gqa-2k]=90 [paths-1k]=260 [profile-1k]=200)

bench() {  # bench speed at SIZE with fast paths FAST into folder NAME; more arguments are passed on
  local name=$1 size=$2 fast=$3
  shift 3
  python3 -m tapelm.cli bench speed --device cuda --dtype bf16 --sizes "$size" --fast-paths "$fast" --no-progress \
    --out "$work/$name" "$@"
}

stage() {  # run stage NAME; FAST is the fast-path setting the tests earned
  case $1 in
    tests)  # 8 workers; with pytest-timeout (on the GPU image) a test that hangs fails after 240 s instead;
      # VISIT_TESTS, a pytest -k expression, keeps only the tests it names (e.g. a rerun of the files that failed)
      local options="-n ${VISIT_WORKERS:-8} -vv"  # -vv against the doctor's -q: each test named
      python3 -c "import pytest_timeout" 2>/dev/null && options="$options --timeout 240"
      [[ -n ${VISIT_TESTS:-} ]] && options="$options -k '$VISIT_TESTS'"
      PYTEST_ADDOPTS=$options python3 -m tapelm.cli doctor --out "$work/tests" --skip speed training generation ;;
    eager-1k) bench eager-1k paper-1k "$fast" --pe tape llama --repeats 3 ;;
    reference-1k) bench reference-1k paper-1k off --pe tape --repeats 2 ;;
    fast-1k) bench fast-1k paper-1k on --pe tape --repeats 3 ;;
    compiled-1k) bench compiled-1k paper-1k "$fast" --pe tape --repeats 2 --compile ;;
    eager-4k) bench eager-4k paper-4k "$fast" --pe tape --repeats 2 ;;
    gqa-2k) bench gqa-2k gqa-2k "$fast" --pe tape --repeats 2 ;;
    paths-1k) python3 docs/gpu/fast_path_ablation.py --device cuda --dtype bf16 --size paper-1k --repeats 4 \
      --out "$work/paths-1k" ;;
    profile-1k) python3 docs/gpu/profile_steps.py --device cuda --dtype bf16 --size paper-1k --fast-paths "$fast" \
      --out "$work/profile-1k" ;;
    *) echo "unknown stage $1" >&2; return 2 ;;
  esac
}

case "${1:-}" in
  prepare)
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl "${wheels[@]}"
    ;;
  run)
    out=${2:?usage: visit.sh run OUT_DIR SECONDS STAGE...} budget=${3:?seconds}
    shift 3
    deadline=$((SECONDS + budget)) work=$(mktemp -d) fast=${VISIT_FAST_PATHS:-auto} status=0
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$work/device.txt"
    python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" \
      | tee -a "$work/device.txt"
    for name in "$@"; do
      if ((SECONDS + ${limit[$name]:-0} > deadline)); then
        echo "== $name: skipped, $((deadline - SECONDS)) s left of the visit, the stage may take ${limit[$name]:-?} s"
        continue
      fi
      seconds=${limit[$name]}
      cap=${VISIT_TESTS_SECONDS:-480}
      [[ $name == tests ]] && seconds=$((deadline - SECONDS < cap ? deadline - SECONDS : cap))
      echo "== $name (fast paths $fast; at most $seconds s)"
      started=$SECONDS
      timeout "$seconds" bash -c "$(declare -f bench stage); work=$work fast=$fast stage $name" \
        > "$work/$name.log" 2>&1
      code=$?
      echo "== $name: exit $code after $((SECONDS - started)) s"
      tail -n 25 "$work/$name.log"
      ((code == 0)) || status=1
      if [[ $name == tests ]] && grep -q '"status": "passed"' "$work"/tests/doctor-*.json 2>/dev/null; then
        fast=on
      fi
      tar czf "$out/visit.tgz" -C "$work" .
    done
    exit $status
    ;;
  *)
    echo "usage: visit.sh prepare | run OUT_DIR SECONDS STAGE..." >&2
    exit 2
    ;;
esac
