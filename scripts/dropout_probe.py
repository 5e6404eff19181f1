"""bias+GELU+dropout at the suite's size, stitched (forced) against jax.jit: how many elements one
mask drops and the other keeps (the drawn bits must be identical), and the largest difference of
the others.

    python3 scripts/dropout_probe.py
"""
import os
os.environ["JAXSTITCH_TUNE"] = "min_gain_pct=0"
import jax, jax.numpy as jnp, numpy as np
import jaxstitch
from jaxstitch.workloads import WORKLOADS
w = WORKLOADS["bias_gelu_dropout"]
for dt in (jnp.float32, jnp.bfloat16):
    args = w.make_inputs(jax.random.key(1), dt, False)
    ref = np.asarray(jax.jit(w.fn)(*args), np.float64)
    got = np.asarray(jaxstitch.jit(w.fn)(*args), np.float64)
    zr, zg = ref == 0, got == 0
    both = ~zr & ~zg
    rel = np.abs(got - ref)[both] / np.abs(ref[both])
    i = np.unravel_index(np.argmax(np.abs(got - ref)), ref.shape)
    print(dt.__name__, "mask mismatches", int((zr != zg).sum()), "of", ref.size, "zeros", int(zr.sum()),
          "max elem rel", rel.max(), "n rel>1e-2", int((rel > 1e-2).sum()), "worst at", i, ref[i], got[i])
    x, b = np.asarray(args[0], np.float64), np.asarray(args[1], np.float64)
    print("   input there", x[i], b[i[1]], x[i] + b[i[1]])
