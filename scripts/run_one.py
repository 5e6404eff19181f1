"""Run one suite workload stitched at its full size a few times: a target for profilers.

    ncu --clock-control none -k jaxstitch_kernel -c 1 python3 scripts/run_one.py softmax_fwdbwd bfloat16
"""
import sys

import jax
import jax.numpy as jnp

import jaxstitch
from jaxstitch.bench.workloads import WORKLOADS

name, dtype = sys.argv[1], getattr(jnp, sys.argv[2] if len(sys.argv) > 2 else "float32")
w = WORKLOADS[name]
args = w.make_inputs(jax.random.key(0), dtype, False)
f = jaxstitch.jit(w.fn)
for _ in range(3):
    jax.block_until_ready(f(*args))
print(jaxstitch.explain(w.fn, *args))
