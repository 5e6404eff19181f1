#!/usr/bin/env bash
# The multi-GPU check, for a machine with 2+ GPUs, from any directory:
#   bash scripts/spmd_check.sh
# Installs, runs the multi-GPU tests, then examples/dp_train.py (BERT, then GPT) on 1 and 2 GPUs, and
# prints their tables last. Logs go to $OUT when set, else /tmp/jaxstitch_spmd_check.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp/jaxstitch_spmd_check}
mkdir -p "$LOGS"
nvidia-smi --query-gpu=name,memory.total --format=csv
"$PY" -m pip install -q --no-build-isolation --no-deps -e . >"$LOGS/install.log" 2>&1 || tail -n 30 "$LOGS/install.log"
if ! "$PY" -c "import flatbuffers" 2>/dev/null && ls .whl/flatbuffers-*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps .whl/flatbuffers-*.whl >>"$LOGS/install.log" 2>&1
fi
echo "== multi-GPU tests"
"$PY" -m pytest -q tests/test_gpu_spmd.py -x 2>&1 | tee "$LOGS/spmd_tests.log" | tail -n 15
tests=$?
for model in ${MODELS:-bert gpt}; do
  echo "== dp_train $model"
  "$PY" examples/dp_train.py --model "$model" --devices 2 --steps "${STEPS:-30}" 2>&1 | tee "$LOGS/dp_$model.log" | tail -n 8
done
echo "== summary"
grep -h "passed\|failed" "$LOGS/spmd_tests.log" | tail -n 1
for model in ${MODELS:-bert gpt}; do grep -A6 "data-parallel train step" "$LOGS/dp_$model.log"; done
