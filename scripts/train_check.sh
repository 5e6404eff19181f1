#!/usr/bin/env bash
# The training examples on a GPU machine, from any directory:
#   bash scripts/train_check.sh [bert gpt dien ...]
# Installs the project (editable, no network), runs each example's 100 steps under jax.jit and
# jaxstitch.jit, writes each one's numbers to $OUT/<name>.json (else /tmp/jaxstitch_train) for
# scripts/plot_steps.py, and ends with one line per example. DTYPE=bfloat16 runs BERT and GPT in
# mixed precision; STEPS changes the step count; EXTRA adds arguments to every example.
set -u -o pipefail

cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp/jaxstitch_train}
mkdir -p "$LOGS"
"$PY" -m pip install -q --no-build-isolation --no-deps -e . >"$LOGS/install.log" 2>&1 || tail -n 30 "$LOGS/install.log"

models=("$@")
[ ${#models[@]} -eq 0 ] && models=(bert gpt dien)
summary=()
for m in "${models[@]}"; do
  args=(--steps "${STEPS:-100}" --json "$LOGS/$m${DTYPE:+_$DTYPE}.json")
  [ -n "${DTYPE:-}" ] && [ "$m" != dien ] && args+=(--dtype "$DTYPE")
  echo "== $m ${args[*]}"
  # shellcheck disable=SC2086  # EXTRA is split into words on purpose
  "$PY" "examples/${m}_train.py" "${args[@]}" ${EXTRA:-} 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" \
    | tee "$LOGS/$m.log" | tail -n 8
  summary+=("$m: exit ${PIPESTATUS[0]}; $(grep '^speedup' "$LOGS/$m.log")")
done
echo
printf '%s\n' "${summary[@]}"
