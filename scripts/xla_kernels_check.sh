#!/usr/bin/env bash
# One device call for XLA's own kernel call (kernels/xla_kernel.py, JAXSTITCH_TUNE=xla_kernels=1):
# its GPU tests, then BERT's step with and without it (step_ab.py, one process), then how often XLA
# records the step's command buffers again (cmd_buffer_updates.py). Each step has its own time
# limit, so a slow one leaves the others their share of the device runner's 10 minutes.
#   bash scripts/xla_kernels_check.sh            (MODEL=gpt or DTYPE=bfloat16 to change the step)
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
MODEL=${MODEL:-bert}
DTYPE=${DTYPE:-float32}
"$PY" -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1 || echo "install failed"
if ! "$PY" -c "import flatbuffers" 2>/dev/null && ls .whl/flatbuffers-*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps .whl/flatbuffers-*.whl >/dev/null 2>&1
fi
# The driver loads the call's PTX (JIT): PTX newer than the driver's CUDA version fails to load.
"$PY" -c "from jaxstitch.kernels import nvrtc, xla_kernel
print('NVRTC', nvrtc.version(), 'PTX', nvrtc.compile_ptx('extern \"C\" __global__ void k(){}', 'sm_90').split('.version ')[1].split()[0],
      'driver CUDA', xla_kernel.driver_cuda_version())"
echo "== GPU tests of XLA's kernel call"
timeout 200 "$PY" -m pytest -q -m gpu tests/test_gpu_correctness.py -k xla_kernel --timeout=150 2>&1 | tail -6
echo "== $MODEL $DTYPE step, with and without (wall clock, one process)"
timeout 190 "$PY" -u scripts/step_ab.py --model "$MODEL" --dtype "$DTYPE" --rounds 5 --steps 10 \
  --tune xla_kernels=1 2>&1 | grep -v Warning
echo "== command buffer updates"
timeout 180 "$PY" -u scripts/cmd_buffer_updates.py --model "$MODEL" --dtype "$DTYPE" --steps 5 \
  --tune xla_kernels=1 2>&1 | grep -v Warning
