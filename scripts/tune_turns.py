"""Stitched variants of one suite workload (JAXSTITCH_TUNE specs) against the default plan and
jax.jit, timed in turns: rounds of GPU time per call (CUPTI span, median of calls), so that a
variant's difference can be told from run-to-run noise. Also prints each variant's mapping.

    python scripts/tune_turns.py softmax_fwdbwd_long --dtype float32 --tunes factors=0 factors=2
"""
import argparse
import os
import statistics
import sys

import torch  # noqa: F401  (first: device_time's CUPTI profiler shares its CUDA context with jax)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxstitch  # noqa: E402
from device_time import one_call  # noqa: E402
from jaxstitch import bench  # noqa: E402
from jaxstitch.workloads import WORKLOADS  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", choices=sorted(WORKLOADS))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tunes", nargs="*", default=[])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=9)
    opts = ap.parse_args()
    w = WORKLOADS[opts.workload]
    args = w.make_inputs(jax.random.key(0), getattr(jnp, opts.dtype), False)
    names, progs = ["jax.jit", "default"], [jax.jit(w.fn), jaxstitch.jit(w.fn)]
    for tune in opts.tunes:
        with bench._tuned(tune):  # (jaxstitch.jit reads its configuration when it is made)
            progs.append(jaxstitch.jit(w.fn))
            names.append(tune)
            print(tune, [r.mapping for r in jaxstitch.explain(w.fn, *args).regions if r.stitched])
    print("default", [r.mapping for r in jaxstitch.explain(w.fn, *args).regions if r.stitched])
    want = progs[0](*args)
    for f in progs[1:]:
        err = bench.max_rel_err(f(*args), want)
        assert err < 1e-2, err
    print(f"{opts.workload} {opts.dtype}, GPU us per call (CUPTI span, median of {opts.calls})")
    print("| round | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for rnd in range(opts.rounds):
        us = [statistics.median(one_call(f, args)[0] for _ in range(opts.calls)) for f in progs]
        print(f"| {rnd} | " + " | ".join(f"{u:.1f}" for u in us) + " |", flush=True)


if __name__ == "__main__":
    main()
