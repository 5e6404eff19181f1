"""GPU check: every benchmark workload, jaxstitch.jit against jax.jit on fresh random inputs.

Outputs are poisoned before each launch (JAXSTITCH_POISON=1) so unwritten elements show as NaN, and
each stitched call runs three times: the results must be bit-identical (a moving error is a race).
"""
import os
import sys
import time

os.environ.setdefault("JAXSTITCH_GUARD", "0")  # (the stitched program itself, not the guard's choice)

os.environ.setdefault("JAXSTITCH_POISON", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxstitch  # noqa: E402
from jaxstitch.bench import workloads  # noqa: E402

TOL = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 5e-3}


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(np.max(np.abs(b)), 1e-30) if b.size else 1.0
    return float(np.max(np.abs(a - b)) / scale) if b.size else 0.0


def main(quick: bool):
    seed = int(time.time()) % 100000
    print(f"seed {seed}")
    failures = 0
    for name, w in workloads.WORKLOADS.items():
        for dt in (jnp.float32, jnp.bfloat16):
            args = w.make_inputs(jax.random.key(seed), dt, quick)
            ref = jax.jit(w.fn)(*args)
            fn = jaxstitch.jit(w.fn)
            outs = [fn(*args) for _ in range(3)]
            rep = jaxstitch.explain(w.fn, *args)
            worst, ok = 0.0, True
            for leaf_r, *leaf_o in zip(jax.tree.leaves(ref), *[jax.tree.leaves(o) for o in outs]):
                tol = TOL.get(jnp.dtype(leaf_r.dtype).name, 0.0)
                e = rel_err(leaf_o[0], leaf_r)
                worst = max(worst, e)
                same = all(np.array_equal(np.asarray(leaf_o[0]), np.asarray(x), equal_nan=True) for x in leaf_o[1:])
                nan_bad = bool(np.any(np.isnan(np.asarray(leaf_o[0], np.float64)))) and not \
                    bool(np.any(np.isnan(np.asarray(leaf_r, np.float64))))
                if e > tol or not same or nan_bad:
                    ok = False
                    print(f"  {name} {jnp.dtype(dt).name}: err {e:.2e} (tol {tol}) identical={same} nan={nan_bad}")
            failures += not ok
            print(f"{'PASS' if ok else 'FAIL'} {name:26s} {jnp.dtype(dt).name:9s} err {worst:.1e} "
                  f"stitched kernels {rep.stitched_kernels} regions {len(rep.regions)}")
    print(f"{failures} failed")
    return failures


if __name__ == "__main__":
    sys.exit(1 if main("--full" not in sys.argv) else 0)
