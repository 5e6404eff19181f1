#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over the newer kernel kinds (scans along rows,
# variadic reductions, transposed tiles) and the paired rotary kernels:
#   bash scripts/sanitize_kinds.sh [CASES]   (default: scans,variadic,transpose,rmsnorm_rope)
# Reports go to $OUT (or /tmp); the summary lines are printed. The host process has segfaulted under
# the tool before: a tool's run is retried once.
cd "$(dirname "$0")/.." || exit 1
CASES=${1:-scans,variadic,transpose,rmsnorm_rope}
LOGS=${OUT:-/tmp}
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in memcheck racecheck; do
  for try in 1 2; do
    timeout "${TOOL_TIMEOUT:-270}" "$CS" --tool "$tool" --kernel-name kns=jaxstitch_kernel python3 scripts/sanitize_run.py "$CASES" \
      > "$LOGS/sanitize_$tool.log" 2>&1
    rc=$?
    echo "== $tool (try $try, exit $rc): $(grep -c '^ok ' "$LOGS/sanitize_$tool.log") ok, $(grep -c '^BAD' "$LOGS/sanitize_$tool.log") bad"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Segmentation|Hazard" "$LOGS/sanitize_$tool.log" | sort | uniq -c | head -n 5
    [ "$rc" -le 1 ] && break
  done
done
