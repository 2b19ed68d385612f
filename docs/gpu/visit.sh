#!/usr/bin/env bash
# A GPU visit in stages that fit the device tool's limits (15 minutes of device time a session, 10 a command, 8 files
# back). docs/GPU.md says what each fast path gave when measured and what the next visit is for.
#
# Here, once, in the repository root (the GPU machine reaches no package registry):
#   echo /.whl/ >> .git/info/exclude && bash docs/gpu/visit.sh prepare
# fetches into .whl/ the wheels tapelm needs beyond the GPU image's packages (its torch, Triton, accelerate, peft,
# huggingface_hub and tokenizers stay). There, as the device tool's command, carrying .whl:
#   bash docs/gpu/visit.sh run "$OUT" SECONDS STAGE...
# runs the stages in order, each only while it fits in SECONDS (each stage's own limit is below), and after each one
# packs everything it wrote into OUT/visit.tgz (the logs and JSON; unpack it under docs/gpu/<device>-<date>/). The
# benchmark stages run on the default paths (`fast_paths="auto"`: those the tests of an earlier visit verified) unless
# VISIT_FAST_PATHS says otherwise (on, off, or path names). VISIT_TESTS (a pytest -k expression) and VISIT_WORKERS
# (default 8) shape the tests. VISIT_DRY_RUN=1 prints each stage's command instead of running it.
# Stages (`next` names the next visit's plan: tests first-calls first-calls-again speed-1k-defaults speed-1k-kernels
# speed-1k-efficient speed-1k-every sharing speed-1k-grape speed-1k-new science):
#   tests        tapelm doctor's law tests on the GPU (`pytest --device cuda -m device`, every fast path on), the
#                shared ones on VISIT_WORKERS pytest workers, those that call Triton kernels (fla's, tapelm's) in
#                VISIT_PROCESSES processes beside them (default 4), a process that fails or dies rerun from the test
#                after it in a fresh one, so that a CUDA fault fails that test only; the JSON rewritten after each
#                result; the doctor stops the tests 25 s before the stage's limit, VISIT_TESTS_SECONDS (default 120)
#   first-calls  tapelm doctor's first calls: each fast path's first training step on a small model (its compiling
#                and autotuning) and whether generate tunes again at a new length, the JSON rewritten after each path
#   first-calls-again  the same in a second process, which finds Triton's kernels and autotuning on disk
#   speed-1k-defaults  bench speed, 12 x 768 at 1,024 x 16, bf16 autocast, one repetition, the default paths: RoPE,
#                TAPE, T5, FIRE, CoPE, FoX, PaTH, fla's FoX and PaTH models (and `more_rows` below); each
#                speed-1k-* stage rewrites its JSON as each row's measurement ends (a stopped stage keeps every row)
#   speed-1k-kernels   the same, the default paths and state-update-triton, forgetting-attention-fla and
#                path-attention-fla: RoPE, TAPE, FoX, PaTH (each path reaches only its own encoding)
#   speed-1k-efficient the same, the default paths and attention-efficient: RoPE, T5, FIRE, CoPE
#   speed-1k-grape the same, the default paths: RoPE and GRAPE's three encodings (GRAPE-AP builds its bias whole on
#                CUDA until its device test of attention over blocks passes); the stages before it fill the call at
#                their limits, so it runs where they finish early
#   speed-1k-new   the same, the default paths: RoPE and the encodings issue 65 added (PoPE, Wall, stick-breaking,
#                GRAPE-A-Q/K/QK; the step costs their classes declare are estimates until this measures them); like
#                speed-1k-grape it runs where the stages before it finish early
#   speed-1k-every     the same, every fast path on (`--fast-paths on`): RoPE, TAPE
#   sharing      `tapelm sharing mqar`: MQAR's GPU recipe (TAPE, 150 steps) trained 1, 2 and 4 at once on the GPU, and
#                the GPU's steady training throughput at each against one run alone (issue 63: whether the stage should
#                train several runs at once); like speed-1k-grape it runs where the stages before it finish early
#   speed-1k-all bench speed, 12 x 768 at 1,024 x 16, bf16 autocast, one repetition: every encoding, transformers'
#                Llama and fla's FoX and PaTH models, the JSON written as each row's measurement ends (a stopped stage
#                keeps every finished row)
#   eager-1k     bench speed at 1,024 x 16: RoPE, TAPE and transformers' Llama, 3 repetitions
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
#   science      `tapelm stage`: the paper's claims at GPU scale, the next planned runs that fit in what is left of the
#                visit, continuing from docs/results/compare (afterwards `tapelm report --root <unpacked>/science`
#                merges them there; docs/RECIPES.md, "GPU scale")
# Commit what comes back under docs/gpu/ with the device named, and turn on by default (the `verified` entries of
# tapelm/fast_paths.py) each fast path whose tests passed.
#
# The next visit, in one call of at most 9 minutes on an H100 (the device tool's timeout 540 s), whose output is one
# file, OUT/visit.tgz, packed again after each stage (docs/GPU.md has what each stage is expected to take):
#   bash docs/gpu/visit.sh run "$OUT" 530 next
# Each stage starts only if its limit fits in what is left, so the plan's limits add up to at most 530 s with the
# install (tests/test_visit.py checks it with VISIT_DRY_RUN=1, which counts each stage at its limit); the sharing
# measurement, GRAPE's rows and then the science take what the others leave (the science prints the plan's predicted
# GPU minutes at the rates its runs measured). A visit for the science alone (about 11 device minutes with the start):
#   bash docs/gpu/visit.sh run "$OUT" 590 science
# and for the sharing measurement alone, if the next visit's call left it out (about 2 minutes with the install):
#   bash docs/gpu/visit.sh run "$OUT" 130 sharing
# Earlier visits (docs/gpu/h100-*/, h200-*/): a machine started in about 30 s to 2 minutes; the law tests took
# 93-265 s on 8 workers; eager-1k 88 s, eager-4k 35-52 s, gqa-2k 52 s, compiled-1k about 200-232 s (mostly
# compiling), fast-1k 163 s (fla autotunes each kernel inside the first stage that reaches it).
set -uo pipefail
cd "$(dirname "$0")/../.."
wheels=(transformers==5.24.0 flash-linear-attention==0.6.0 fla-core==0.6.0 parameterized==0.9.0 dill==0.4.1
        "regex>=2025.10.22")
# The CUDA default paths of RoPE and TAPE (`fast_paths="auto"`; tests/test_visit.py checks them against
# tapelm/fast_paths.py): the base the speed-1k-kernels and speed-1k-efficient stages add paths to.
defaults="attention-unpadded rotation-triton rotation-autograd state-mixing-triton"
# ---- More bench rows: add rows (names as `tapelm bench speed --pe` takes them) to measure on the default paths in
# ---- the speed-1k-defaults stage; its limit grows by ROW_SECONDS a row (then check the plan still fits: the test).
more_rows=()
defaults_rows=(rope tape t5 fire cope fox path fla-fox fla-path "${more_rows[@]}")
plan=(tests first-calls first-calls-again speed-1k-defaults speed-1k-kernels speed-1k-efficient speed-1k-every
      sharing speed-1k-grape speed-1k-new science)
# A speed-1k-* stage may take 15 s to start and ROW_SECONDS a row beside RoPE (one repetition: both models built,
# two alternations of training steps, memory, prefill, 64 tokens decoded at batch 1 and 8 each); every-path rows 40 s
# more for their first calls (the issue's target: a first training step within 60 s on a fresh machine).
ROW_SECONDS=12
declare -A limit=([tests]=${VISIT_TESTS_SECONDS:-120} [first-calls]=60 [first-calls-again]=30
                  [speed-1k-defaults]=$((15 + ROW_SECONDS * (${#defaults_rows[@]} - 1)))
                  [speed-1k-kernels]=$((15 + ROW_SECONDS * 3)) [speed-1k-efficient]=$((15 + 2 * ROW_SECONDS * 3))
                  [speed-1k-every]=$((15 + 40 + ROW_SECONDS)) [speed-1k-grape]=$((15 + ROW_SECONDS * 3))
                  [speed-1k-new]=$((15 + ROW_SECONDS * 6)) [sharing]=100 [speed-1k-all]=150 [science]=150 [eager-1k]=120
                  [reference-1k]=70 [fast-1k]=200 [compiled-1k]=270 [eager-4k]=150 [gqa-2k]=90 [paths-1k]=260
                  [profile-1k]=200)
# stages that keep what they finished when stopped and take what is left of the visit once their own limit above is
# left
elastic=" speed-1k-all science "

bench() {  # bench speed at SIZE with fast paths FAST (words) into folder NAME; more arguments are passed on
  local name=$1 size=$2 fast=$3
  shift 3
  # shellcheck disable=SC2086 (FAST may be several path names)
  $python -m tapelm.cli bench speed --device cuda --dtype bf16 --sizes "$size" --fast-paths $fast --no-progress \
    --out "$work/$name" "$@"
}

stage() {  # run stage NAME; FAST is the fast-path setting of the benchmark stages
  case $1 in
    tests)  # VISIT_TESTS, a pytest -k expression, keeps only the tests it names (e.g. a rerun of those that failed)
      $python -m tapelm.cli doctor --out "$work/tests" --skip first-calls speed training generation \
        --workers "${VISIT_WORKERS:-8}" --processes "${VISIT_PROCESSES:-4}" --seconds "$((seconds - 25))" \
        ${VISIT_TESTS:+--select "$VISIT_TESTS"} ;;
    first-calls|first-calls-again)
      $python -m tapelm.cli doctor --out "$work/$1" --skip tests speed training generation ;;
    speed-1k-defaults) bench speed-1k-defaults paper-1k auto --repeats 1 --pe "${defaults_rows[@]}" ;;
    speed-1k-kernels) bench speed-1k-kernels paper-1k \
      "$defaults state-update-triton forgetting-attention-fla path-attention-fla" --repeats 1 --pe rope tape fox path ;;
    speed-1k-efficient) bench speed-1k-efficient paper-1k "$defaults attention-efficient" --repeats 1 \
      --pe rope t5 fire cope ;;
    speed-1k-every) bench speed-1k-every paper-1k on --repeats 1 --pe rope tape ;;
    speed-1k-grape) bench speed-1k-grape paper-1k auto --repeats 1 --pe rope grape-m-fixed grape-m grape-ap ;;
    speed-1k-new) bench speed-1k-new paper-1k auto --repeats 1 --pe rope pope wall stickbreaking grape-a-q grape-a-k \
      grape-a-qk ;;
    speed-1k-all) bench speed-1k-all paper-1k "$fast" --repeats 1 --pe rope tape llama t5 fire cope fox fla-fox path \
      fla-path alibi xpos randpe nope sinusoidal learned grape-m-fixed grape-m grape-ap grape-a-q grape-a-k grape-a-qk \
      pope wall stickbreaking ;;
    sharing) $python -m tapelm.cli sharing mqar --pe tape --runs 1 2 4 --steps 150 --device 0 --root "$work/sharing" ;;
    science)  # the next GPU-scale comparison runs that fit, continuing from the archived ones; 25 s to write back
      $python -m tapelm.cli stage --budget-seconds "$((seconds - 25))" --out "$work/science" \
        --archive docs/results/compare --data-workers 12 --no-progress ;;
    eager-1k) bench eager-1k paper-1k "$fast" --pe tape llama --repeats 3 ;;
    reference-1k) bench reference-1k paper-1k off --pe tape --repeats 2 ;;
    fast-1k) bench fast-1k paper-1k on --pe tape --repeats 3 ;;
    compiled-1k) bench compiled-1k paper-1k "$fast" --pe tape --repeats 2 --compile ;;
    eager-4k) bench eager-4k paper-4k "$fast" --pe tape --repeats 2 ;;
    gqa-2k) bench gqa-2k gqa-2k "$fast" --pe tape --repeats 2 ;;
    paths-1k) $python docs/gpu/fast_path_ablation.py --device cuda --dtype bf16 --size paper-1k --repeats 4 \
      --out "$work/paths-1k" ;;
    profile-1k) $python docs/gpu/profile_steps.py --device cuda --dtype bf16 --size paper-1k --fast-paths "$fast" \
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
    [[ $* == next ]] && set -- "${plan[@]}"
    deadline=$((SECONDS + budget)) work=$(mktemp -d) fast=${VISIT_FAST_PATHS:-auto} status=0 python=python3
    mkdir -p "$out"
    if [[ -n ${VISIT_DRY_RUN:-} ]]; then  # each stage prints its command instead of running it (tests/test_visit.py)
      python="echo python3" clock=0 deadline=$budget  # a clock of the stages' limits only (`now` below)
    else
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
      export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$work/device.txt"
      python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" \
        | tee -a "$work/device.txt"
    fi
    for name in "$@"; do
      now=${clock:-$SECONDS}
      if ((now + ${limit[$name]:-0} > deadline)); then
        echo "== $name: skipped, $((deadline - now)) s left of the visit, the stage may take ${limit[$name]:-?} s"
        continue
      fi
      seconds=${limit[$name]}
      [[ $elastic == *" $name "* ]] && seconds=$((deadline - now))
      echo "== $name (fast paths $fast; at most $seconds s)"
      timeout "$seconds" bash -c "$(declare -f bench stage; declare -p defaults defaults_rows); work='$work' \
        fast='$fast' seconds=$seconds python='$python' stage $name" \
        > "$work/$name.log" 2>&1
      code=$?
      [[ -n ${VISIT_DRY_RUN:-} ]] && clock=$((now + seconds))  # a dry stage counts as taking all its time
      echo "== $name: exit $code after $((${clock:-$SECONDS} - now)) s"
      tail -n 25 "$work/$name.log"
      ((code == 0)) || status=1
      tar czf "$out/visit.tgz" -C "$work" .
    done
    exit $status
    ;;
  *)
    echo "usage: visit.sh prepare | run OUT_DIR SECONDS STAGE..." >&2
    exit 2
    ;;
esac
