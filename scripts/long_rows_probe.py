"""Where the GPU time of few very long rows goes: a language model's log-softmax statistics over a
256k vocabulary (`token_stats`, two reduction levels; `--fn logsumexp`: one) at 1 to ~100 rows,
jax.jit against jaxstitch plans (default and forced splits), each call's GPU events from CUPTI
(kernels, memsets) with their gaps.

    python3 scripts/long_rows_probe.py [--vocab 262144] [--rows 1 24 47 96] [--tunes "" splits=1]

Prints, per (rows, program): the span of a median call, then that call's events as
`+start name dur` in µs, so launch gaps, memsets and kernel times separate. A GPU machine with
torch (its CUPTI profiler); a diagnosis tool, not a benchmark of record: it times each program's
calls together, one program after another, and that order alone moved one cubin 10% (34 rows,
26.8 us timed second, 24.4 timed fifth). Compare plans with scripts/family_vs_fixed.py or
family_bench.py, which take programs in turns.
"""
import argparse
import os
import statistics
import sys

import torch  # noqa: F401  (first: the CUPTI profiler shares its CUDA context with jax)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")]

import jaxstitch  # noqa: E402
from device_time import GPU_EVENTS, gpu_events  # noqa: E402
from jaxstitch import bench  # noqa: E402
from test_families import token_stats  # noqa: E402


def logsumexp(x):
    """One reduction level (a max and a sum of exponentials, one pass online): one grid barrier."""
    return jax.nn.logsumexp(x, axis=-1)


FUNCTIONS = {"token_stats": token_stats, "logsumexp": logsumexp}


def stitched(fn, tune: str, x):
    """jaxstitch.jit(fn) planned under JAXSTITCH_TUNE=tune (traced here, while it is set)."""
    with bench._tuned(tune):  # (jaxstitch.jit reads its configuration when it is made)
        f = jaxstitch.jit(fn)
        jax.block_until_ready(f(x))
        regions = jaxstitch.explain(fn, x).regions
    return f, regions


def events_of(f, x, burst=1):
    """(GPU span, events): the GPU's events and the host's CUDA API calls of `burst` calls dispatched
    back to back, in µs from the first GPU event (host calls before it have negative starts)."""
    jax.block_until_ready(f(x))

    def run():
        for _ in range(burst):
            out = f(x)
        jax.block_until_ready(out)
    ev = sorted(gpu_events(run, cats=None), key=lambda e: e["ts"])
    gpu = [e for e in ev if e.get("cat") in GPU_EVENTS]
    t0 = gpu[0]["ts"]
    span = max(e["ts"] + e["dur"] for e in gpu) - t0
    api = [e for e in ev if e.get("cat") not in GPU_EVENTS and e["dur"] >= 1.0 and "cu" in e["name"].lower()]
    shown = sorted(gpu + api, key=lambda e: e["ts"])
    return span, [(e["ts"] - t0, ("" if e in gpu else "host ") + e["name"][:48], e["dur"]) for e in shown]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 24, 47, 96])
    ap.add_argument("--tunes", nargs="*", default=["", "splits=1"])
    ap.add_argument("--calls", type=int, default=7)
    ap.add_argument("--fn", choices=sorted(FUNCTIONS), default="token_stats")
    ap.add_argument("--burst", type=int, default=1, help="calls dispatched back to back per profile")
    opts = ap.parse_args()
    print(jax.devices()[0].device_kind, flush=True)
    summary = []
    for rows in opts.rows:
        x = jax.random.normal(jax.random.key(rows), (1, rows, opts.vocab), jnp.float32) * 3
        fn = FUNCTIONS[opts.fn]
        want = jax.jit(fn)(x)
        progs = [("jax.jit", jax.jit(fn), None)]
        for tune in opts.tunes:
            f, regions = stitched(fn, tune, x)
            err = bench.max_rel_err(f(x), want)
            plans = "; ".join(f"{'stitched' if r.stitched else 'XLA'}: {r.mapping}, est {r.est_us or 0:.1f} "
                              f"vs xla {r.xla_est_us or 0:.1f}" for r in regions)
            progs.append((f"stitch[{tune}]", f, f"{plans} | err {err:.1e}"))
        for name, f, about in progs:
            calls = sorted((events_of(f, x, opts.burst) for _ in range(opts.calls)), key=lambda c: c[0])
            span, ev = calls[len(calls) // 2]
            summary.append((rows, name, span))
            print(f"\n== rows {rows} {name}: span {span:.1f} us" + (f"  ({about})" if about else ""))
            for start, ename, dur in ev:
                print(f"   +{start:7.1f} {dur:7.1f}  {ename}")
            sys.stdout.flush()
    print("\n| rows | program | GPU span us |")
    print("|---:|---|---:|")
    for rows, name, span in summary:
        print(f"| {rows} | {name} | {span:.1f} |")


if __name__ == "__main__":
    main()
