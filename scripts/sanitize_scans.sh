#!/usr/bin/env bash
# compute-sanitizer's racecheck and memcheck on the persistent scan kernels (plan/scan.py), on a GPU
# machine: bash scripts/sanitize_scans.sh. CASES: scripts/sanitize_run.py's cases, comma-separated
# (default: one of each kind of recurrent test case). Each case runs in a process of its own under
# each tool, bounded by LIMIT seconds (default 90): the host process sometimes segfaults under the
# tool (4 of 21 runs once), so a crash loses one case and is retried twice. Nothing is piped:
# a `timeout` ends compute-sanitizer, but the Python process under it may live on and, through a
# pipe, keep a reader waiting (a device call's whole time was once lost that way); leftovers are killed.
set -u
cd "$(dirname "$0")/.." || exit 1
LOGS=${OUT:-/tmp/jaxstitch_sanitize}
mkdir -p "$LOGS"
# No command buffers (the tools see each launch) and no autotuning (XLA's candidate kernels would
# run under the tool too).
export XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0" JAX_DEFAULT_MATMUL_PRECISION=float32
DEFAULT=gru_grad,gru_grad_301_rows,gru_reverse,bias_sum,row_softmax_over_batch,features_first,normalized_cell,two_axis_product
IFS=, read -r -a cases <<<"${CASES:-$DEFAULT}"
for case in "${cases[@]}"; do
  for tool in racecheck memcheck; do
    log="$LOGS/sanitize_${tool}_${case}.log"
    for attempt in 1 2 3; do  # (the host process sometimes segfaults under the tool: exit 139)
      timeout -k 10 "${LIMIT:-90}" compute-sanitizer --tool "$tool" --kernel-name kns=jaxstitch_kernel \
        python3 scripts/sanitize_run.py "persistent/$case" >"$log" 2>&1 </dev/null
      rc=$?
      pkill -9 -f scripts/sanitize_run.py 2>/dev/null
      [ "$rc" -eq 139 ] || break
    done
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -n 1)
    result=$(grep -E "^(ok|BAD) " "$log" | tail -n 1 | cut -c1-60)
    echo "$tool $case: exit $rc (attempt $attempt); ${summary:-no summary}; ${result:-no result}"
  done
done
