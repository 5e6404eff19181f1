"""A shape family's kernel against the fixed-shape kernel of the same rows: per-token statistics over
a 256k vocabulary, jax.jit, jaxstitch.jit planned for the shape, and the exported family, timed in
turns (three rounds, GPU time per call by CUPTI, median of calls) to tell a family's cost from
run-to-run noise.

    python scripts/family_vs_fixed.py [--rows 33 34 35 36] [--vocab 262144] [--tunes splits=7 ...]

`--tunes`: more fixed-shape programs, each planned under JAXSTITCH_TUNE=spec, in the same turns.
"""
import argparse
import os
import statistics
import sys

os.environ.setdefault("JAXSTITCH_GUARD", "0")  # (the stitched program itself, not the guard's choice)

import torch  # noqa: F401  (first: device_time's CUPTI profiler shares its CUDA context with jax)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")]

import jaxstitch  # noqa: E402
from device_time import one_call  # noqa: E402
from family_bench import export  # noqa: E402
from jaxstitch import bench  # noqa: E402
from test_families import token_stats  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="*", default=[33, 34, 35, 36])
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--calls", type=int, default=9)
    ap.add_argument("--tunes", nargs="*", default=[])
    opts = ap.parse_args()
    family, region = export(opts.vocab, "")
    print(region.variants, flush=True)
    print("| rows | round | jax.jit | fixed | family |" + "".join(f" {t} |" for t in opts.tunes))
    print("|---:|---:|---:|---:|---:|" + "---:|" * len(opts.tunes))
    for rows in opts.rows:
        x = jax.random.normal(jax.random.key(rows), (1, rows, opts.vocab), jnp.float32) * 3
        progs = [jax.jit(token_stats), jaxstitch.jit(token_stats), family]
        for tune in opts.tunes:
            with bench._tuned(tune):  # (jaxstitch.jit reads its configuration when it is made)
                progs.append(jaxstitch.jit(token_stats))
                jax.block_until_ready(progs[-1](x))
        want = progs[0](x)
        for f in progs:
            err = bench.max_rel_err(f(x), want)
            assert err < 1e-4, err
        for rnd in range(3):
            us = [statistics.median(one_call(f, [x])[0] for _ in range(opts.calls)) for f in progs]
            print(f"| {rows} | {rnd} | " + " | ".join(f"{u:.1f}" for u in us) + " |", flush=True)


if __name__ == "__main__":
    main()
