"""A target for Nsight Compute: transformer row kernels with one stitched kernel each (the norm
backwards of colreduce_probe.py, with and without their column sums, and a softmax fwd+bwd), each
called 4 times. ncu flushes the L2 before every kernel it profiles, so its times are those of inputs
read from HBM, as inside a train step (a probe's repeated calls on 25 MB find them in the 50 MB L2).

    JAXSTITCH_TUNE=stages=3 ncu --clock-control none --kernel-name jaxstitch_kernel \\
        --metrics gpu__time_duration.sum --csv python3 scripts/row_kernels_ncu.py

Prints one CASE line per function (its stitched kernels' mapping, grid, registers, shared memory);
ncu's rows follow in call order, 4 a function.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import colreduce_probe as probe  # noqa: E402
import jaxstitch  # noqa: E402
from jaxstitch.workloads import WORKLOADS  # noqa: E402

CASES = [
    (probe.rms_bwd, probe.inputs(4096, 768, "bfloat16")),
    (probe.rms_bwd_rows, probe.inputs(4096, 768, "bfloat16")),
    (probe.ln_bwd, probe.inputs(4096, 768, "float32")),
    (probe.ln_bwd, probe.inputs(4096, 768, "bfloat16")),
    (WORKLOADS["softmax_fwdbwd"].fn, WORKLOADS["softmax_fwdbwd"].draw(jax.random.key(0), jnp.bfloat16, 49152, 512)),
]

for fun, args in CASES:
    stitched = [r for r in jaxstitch.explain(fun, *args).regions if r.stitched]
    print("CASE", getattr(fun, "__name__", "?"), args[0].dtype, len(stitched),
          [(r.mapping, r.grid, r.registers, r.smem_bytes) for r in stitched], flush=True)
    f = jaxstitch.jit(fun)
    for _ in range(4):
        jax.block_until_ready(f(*args))
