#!/usr/bin/env bash
# Session 28's GPU check for paired halves (plan/pairs.py): the GPU tests that run paired kernels,
# the bfloat16 GRU at a seed that once missed its tolerance (now judged against float32), and the
# rotary workloads' GPU time as planned (paired) and with pairs=0 (forced), against jax.jit.
cd "$(dirname "$0")/.." || exit 1
python3 -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1
pip install -q --no-index --no-deps .whl/*.whl >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 -m pytest -q -m gpu tests/test_gpu_correctness.py -p no:cacheprovider \
  -k "pair or data_moving or rope or dien_gru" 2>&1 | tail -n 4
JAXSTITCH_TEST_SEED=1473499434198400060 timeout 120 python3 -m pytest -q -m gpu \
  tests/test_gpu_correctness.py -p no:cacheprovider -k "dien_gru" 2>&1 | grep -E "max error|passed|failed" | cut -c1-300
timeout 240 python3 scripts/device_time.py --only rmsnorm_rope_fwd rmsnorm_rope_fwdbwd \
  --tune "min_gain_pct=0,pairs=0" 2>&1 | grep -v Warn | tail -n 12
