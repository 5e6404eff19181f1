#!/usr/bin/env bash
# compute-sanitizer's racecheck and memcheck on the persistent scan kernels (plan/scan.py), on a GPU
# machine: bash scripts/sanitize_scans.sh. CASES picks scripts/sanitize_run.py's cases by name prefix
# (default: the recurrent test cases), LIMIT bounds each tool's run in seconds (default 240).
# Each run writes a log of its own and nothing is piped: a `timeout` ends compute-sanitizer, but the
# Python process under it may live on and, through a pipe, keep a reader waiting (session 25 lost
# its device time that way); what is left of it is killed before the next tool.
set -u
cd "$(dirname "$0")/.." || exit 1
LOGS=${OUT:-/tmp/jaxstitch_sanitize}
mkdir -p "$LOGS"
export XLA_FLAGS=--xla_gpu_enable_command_buffer= JAX_DEFAULT_MATMUL_PRECISION=float32
for tool in racecheck memcheck; do
  log="$LOGS/sanitize_$tool.log"
  timeout -k 10 "${LIMIT:-240}" compute-sanitizer --tool "$tool" --kernel-name kns=jaxstitch_kernel \
    python3 scripts/sanitize_run.py "${CASES:-persistent}" >"$log" 2>&1 </dev/null
  echo "== $tool: exit $? (log: $log)"
  pkill -9 -f scripts/sanitize_run.py 2>/dev/null
  grep -E "^(ok|BAD) |ERROR SUMMARY|RACECHECK SUMMARY|Hazard|hazard" "$log" | tail -n 25
done
