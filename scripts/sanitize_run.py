"""Every suite workload (quick shapes, plus long and odd shapes), the scan, variadic-reduce and
transposed-tile test cases (tests/test_scans.py, tests/test_variadic.py, tests/test_tile_transpose.py)
and the persistent scans (tests/recurrent.py) stitched once: a short program for compute-sanitizer, whose memcheck / racecheck / synccheck then see
every kind of kernel we generate (register rows, shared-memory reductions, async staging, shared and
global stashes, grid barriers, scans' warp totals, combiners' warp partials, transposed tiles,
whole recurrent scans).

    compute-sanitizer --tool racecheck --kernel-name kns=jaxstitch_kernel python3 scripts/sanitize_run.py [START:STOP | NAME,...]

(NAME: a case's name, or the start of several: "persistent" for every scan kernel.)

Regions are stitched even where the cost model would leave them to XLA, except in the optimizer
update, whose chains are launched together (remote stitching) only because each alone is left
to XLA; the extra few-rows shapes run with task splitting on (rows split over blocks, grid
barriers). Exit status 1 if a result differs from jax.jit (the sanitizer's own findings are in its
report).
"""
import contextlib
import os
import sys

os.environ.setdefault("JAXSTITCH_GUARD", "0")  # (the stitched program itself, not the guard's choice)

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import jaxstitch  # noqa: E402
from jaxstitch.bench.workloads import WORKLOADS  # noqa: E402
from strategies import force_stitching, random_inputs  # noqa: E402
from test_scans import CASES as SCAN_CASES  # noqa: E402
from test_variadic import CASES as VARIADIC_CASES  # noqa: E402
from test_tile_transpose import CASES as TRANSPOSE_CASES  # noqa: E402
from recurrent import CASES as RECURRENT_CASES  # noqa: E402

UNFORCED = ("adamw_bert",)
# (32 x 262144: float32 rows split in two rounds of tasks, mapping._stash_in_rounds; 6000 DIEN tiles:
# several a warp, plan/tile.TILE_TEAMS)
EXTRA = [("softmax_fwdbwd", (5, 40000)), ("xent_fwdbwd", (64, 32000)), ("layernorm_fwdbwd", (37, 1021)),
         ("softmax_fwdbwd", (32, 262144)), ("dien_attention_fwdbwd", (6000, 50, 36))]


def _test_case(fun, specs):
    def draw(key, dtype):
        return [jnp.asarray(a, dtype) for a in random_inputs(specs, 1)]
    return fun, draw


cases = [(name, shape, WORKLOADS[name].fn, lambda key, dtype, name=name, shape=shape:
          WORKLOADS[name].draw(key, dtype, *shape))
         for name, shape in [(n, tuple(w.quick_shape)) for n, w in WORKLOADS.items()] + EXTRA]
cases += [(f"{kind}/{n}", entry[1][0].shape, *_test_case(*entry[:2]))
          for kind, table in (("scans", SCAN_CASES), ("variadic", VARIADIC_CASES), ("transpose", TRANSPOSE_CASES))
          for n, entry in table.items()]
cases += [(f"persistent/{n}", (), fn, lambda key, dtype, make=make: make())
          for n, (fn, make, planned) in RECURRENT_CASES.items() if planned]
if len(sys.argv) > 1 and ":" in sys.argv[1]:  # a slice "START:STOP" of the cases (a crash of the tool then loses less)
    start, _, stop = sys.argv[1].partition(":")
    cases = cases[int(start or 0):int(stop) if stop else None]
elif len(sys.argv) > 1:  # names, comma-separated: a case of that name, else those it starts
    wanted, names = sys.argv[1].split(","), {c[0] for c in cases}  # ("persistent": the scan kernels)
    cases = [c for c in cases if any(c[0] == w or (w not in names and c[0].startswith(w)) for w in wanted)]
bad = 0
for name, shape, fn, draw in cases:
    with contextlib.nullcontext() if name in UNFORCED else force_stitching():
        # (a persistent case makes its own inputs, of its own dtype: once)
        for dtype in (jnp.float32,) if name.startswith("persistent/") else (jnp.float32, jnp.bfloat16):
            args = draw(jax.random.key(1), dtype)
            if (name, shape) in EXTRA:
                os.environ["JAXSTITCH_TUNE"] = "splits=0"  # read when jaxstitch.jit is made
            got = jax.block_until_ready(jaxstitch.jit(fn)(*args))
            n = jaxstitch.explain(fn, *args).stitched_kernels
            os.environ.pop("JAXSTITCH_TUNE", None)
            want = jax.block_until_ready(jax.jit(fn)(*args))
            err = max(float(np.max(np.abs(np.asarray(g, np.float32) - np.asarray(x, np.float32))))
                      / max(float(np.max(np.abs(np.asarray(x, np.float32)))), 1e-30)
                      for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
            # (a persistent case's inputs carry their own dtype: the tolerance follows the narrowest)
            half = any(a.dtype in (jnp.bfloat16, jnp.float16) for a in jax.tree.leaves(args))
            ok = np.isfinite(err) and err < (2e-2 if half else 1e-4)
            bad += not ok
            print(f"{'ok ' if ok else 'BAD'} {name} {jnp.dtype(dtype).name if shape else ''} {shape}: {n} stitched, "
                  f"max err {err:.2g} of max |jax.jit|", flush=True)
sys.exit(1 if bad else 0)
