#!/usr/bin/env bash
# Session 28's GPU check for paired halves (plan/pairs.py): the GPU tests that run paired kernels
# (forced), a seed that failed the bfloat16 GRU's tolerance once, with and without in-place sums,
# and the rotary workloads' GPU time, paired and not (forced), against jax.jit.
cd "$(dirname "$0")/.." || exit 1
python3 -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1
pip install -q --no-index --no-deps .whl/*.whl >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 -m pytest -q -m gpu tests/test_gpu_correctness.py -p no:cacheprovider \
  -k "pair or data_moving or rope" 2>&1 | tail -n 4
for tune in "" "scan_sums=0"; do
  echo "== dien_gru bfloat16, seed 1473499434198400060, JAXSTITCH_TUNE=$tune"
  JAXSTITCH_TUNE=$tune JAXSTITCH_TEST_SEED=1473499434198400060 timeout 120 python3 -m pytest -q -m gpu \
    tests/test_gpu_correctness.py -p no:cacheprovider -k "forced_stitching_matches_xla and bfloat16-dien_gru" 2>&1 \
    | grep -E "max error|passed|failed" | cut -c1-300
done
timeout 240 python3 scripts/device_time.py --only rmsnorm_rope_fwd rmsnorm_rope_fwdbwd \
  --tune "min_gain_pct=0" "min_gain_pct=0,pairs=0" 2>&1 | tail -n 14
