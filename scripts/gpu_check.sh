#!/usr/bin/env bash
# The one check to run on a GPU machine, from any directory:
#   bash scripts/gpu_check.sh
# Steps: GPU info, editable install, launcher smoke test, `pytest -m gpu`, the GPU time of every
# workload (scripts/device_time.py --all, where torch is installed: calls shorter than their host
# dispatch read as host time in the benchmark's wall-clock table), then the benchmark (last, so its
# table is at the end of the output), then a summary of every step's exit status. Logs and bench.json go to
# $OUT when it is set (the device runner's output folder), else to /tmp/jaxstitch_gpu_check.
# Environment: QUICK=1 passes --quick to the benchmark; SKIP_TESTS=1 skips pytest; BENCH_ARGS adds
# benchmark arguments (e.g. BENCH_ARGS="--only softmax_fwdbwd --dtype bfloat16"); PYTHON picks the
# interpreter (default python3). PART=I/N runs every N-th GPU test from the I-th (tests/conftest.py),
# and ONLY_TESTS=1 stops after the tests. The whole set now takes about 1000 s on an H200 (part 1/2
# took 529 s on 2026-11-29, and part 2/2 ran past 465 s), more than one device call's 10 minutes, so
# run it in three parts: `PART=1/3 ONLY_TESTS=1 bash scripts/gpu_check.sh`, then 2/3 and 3/3.
set -u -o pipefail

cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp/jaxstitch_gpu_check}
mkdir -p "$LOGS"

STEPS=()
CODES=()
record() {  # record NAME STATUS
  STEPS+=("$1")
  CODES+=("$2")
}

echo "== gpu"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
record gpu $?

echo "== install (log: $LOGS/install.log)"
"$PY" -m pip install -q --no-build-isolation --no-deps -e . >"$LOGS/install.log" 2>&1
rc=$?
[ "$rc" -eq 0 ] || tail -n 30 "$LOGS/install.log"
record install "$rc"

# jax.export serialization needs flatbuffers; a machine without network gets it from .whl/ (carried).
if ! "$PY" -c "import flatbuffers" 2>/dev/null && ls .whl/flatbuffers-*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps .whl/flatbuffers-*.whl >>"$LOGS/install.log" 2>&1
fi

echo "== smoke launcher"
if [ -f scripts/smoke_launcher.py ]; then
  "$PY" scripts/smoke_launcher.py 2>&1 | tee "$LOGS/smoke.log"
  record smoke $?
else
  echo "scripts/smoke_launcher.py not found: skipped"
  record smoke skip
fi

echo "== gpu tests (log: $LOGS/gpu_tests.log)"
if [ "${SKIP_TESTS:-0}" = 1 ]; then
  echo "SKIP_TESTS=1: skipped"
  record gpu_tests skip
else
  # shellcheck disable=SC2046  # --part and its value as two words
  "$PY" -m pytest -q -m gpu tests -x --timeout=300 $([ -n "${PART:-}" ] && echo --part "$PART") 2>&1 \
    | tee "$LOGS/gpu_tests.log"
  rc=$?
  # pytest exits 5 when no test is collected: no GPU test exists yet, which is not a failure.
  if [ "$rc" -eq 5 ]; then rc="none"; fi
  record gpu_tests "$rc"
fi

if [ "${ONLY_TESTS:-0}" != 1 ]; then
echo "== export: a program exported with symbolic batch and sequence, run in a fresh process"
if [ ! -f out/block.jax ]; then  # (exported on a CPU-only machine and carried, else here)
  mkdir -p out && "$PY" scripts/export_check.py export out/block.jax 2>&1 | tail -n 1
fi
"$PY" scripts/export_check.py run out/block.jax 2>&1 | tee "$LOGS/export.log"
record export $?

echo "== GPU time of every workload (log: $LOGS/device_time.log)"
if "$PY" -c "import torch" 2>/dev/null; then
  # shellcheck disable=SC2086
  "$PY" scripts/device_time.py --all $([ "${QUICK:-0}" = 1 ] && echo --quick) 2>&1 | tee "$LOGS/device_time.log"
  record device_time $?
else
  echo "torch (its CUPTI profiler) is not installed: skipped"
  record device_time skip
fi

echo "== bench (log: $LOGS/bench.log, numbers: $LOGS/bench.json)"
quick=""
[ "${QUICK:-0}" = 1 ] && quick=--quick
# shellcheck disable=SC2086  # $quick and BENCH_ARGS are split into words on purpose
"$PY" -m jaxstitch.bench $quick --json "$LOGS/bench.json" --markdown ${BENCH_ARGS:-} 2>&1 \
  | tee "$LOGS/bench.log"
record bench $?
fi

echo
echo "== summary"
failed=0
summary=""
for i in "${!STEPS[@]}"; do
  code=${CODES[$i]}
  case "$code" in
    0) status=ok ;;
    skip) status=skipped ;;
    none) status="no tests" ;;
    *) status="FAILED (exit $code)"; failed=1 ;;
  esac
  printf '%-10s %s\n' "${STEPS[$i]}" "$status"
  summary="$summary ${STEPS[$i]}=$code"
done
if [ "$failed" -eq 0 ]; then verdict=OK; else verdict=FAILED; fi
echo "gpu_check:$summary -> $verdict"
exit "$failed"
