"""Norm backwards with grid-wide column reductions (dgamma, dbeta) at transformer shapes, alone:
jax.jit against jaxstitch.jit with JAXSTITCH_TUNE specs (default: col_group=8, the former column
finish, and min_threads=1024), GPU time of one call (CUPTI span, median of calls), and
the same backward without its column reductions: what the grid barrier and the finish cost.

    python3 scripts/colreduce_probe.py [--rows 4096 16384] [--tune SPEC ...]
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


def _rms_dx(x, w, dy, rstd):
    xhat = x.astype(jnp.float32) * rstd
    g = dy.astype(jnp.float32) * w.astype(jnp.float32)
    dx = rstd * (g - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    return xhat, dx


def rms_bwd(x, w, dy, res, rstd):
    """GPT's RMSNorm backward: the residual's gradient plus dx, and dw over the rows."""
    xhat, dx = _rms_dx(x, w, dy, rstd)
    dw = jnp.sum(dy.astype(jnp.float32) * xhat, axis=0)
    return res + dx.astype(x.dtype), dw.astype(w.dtype)


def rms_bwd_rows(x, w, dy, res, rstd):
    """The same without dw: no grid barrier."""
    return res + _rms_dx(x, w, dy, rstd)[1].astype(x.dtype)


def ln_bwd(x, w, dy, res, rstd):
    """BERT's layernorm backward (mean taken out of x beforehand): dx, dgamma and dbeta."""
    xhat = x.astype(jnp.float32) * rstd
    g = dy.astype(jnp.float32) * w.astype(jnp.float32)
    dx = rstd * (g - jnp.mean(g, axis=-1, keepdims=True) - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    dyf = dy.astype(jnp.float32)
    return ((res + dx.astype(x.dtype)), jnp.sum(dyf * xhat, axis=0).astype(w.dtype),
            jnp.sum(dyf, axis=0).astype(w.dtype))


def inputs(rows, cols, dtype):
    k = jax.random.split(jax.random.key(0), 5)
    x, dy, res = (jax.random.normal(k[i], (rows, cols)).astype(dtype) for i in range(3))
    w = (1 + 0.1 * jax.random.normal(k[3], (cols,))).astype(dtype)
    rstd = jax.random.uniform(k[4], (rows, 1), minval=0.5, maxval=2.0)
    return x, w, dy, res, rstd


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="*", default=[4096, 16384])
    p.add_argument("--cols", type=int, default=768)
    p.add_argument("--calls", type=int, default=9)
    p.add_argument("--tune", nargs="*", default=["col_group=8", "min_threads=1024"])
    args = p.parse_args()
    bw = bench.measure_bandwidth(False, 10)
    names = ["jax.jit", "jaxstitch"] + args.tune
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; GPU us a call (CUPTI span, median of {args.calls}); "
          "roofline % of jaxstitch's")
    print("| function | rows | dtype | " + " | ".join(names) + " | roofline us | % | grid x regs |")
    print("|---|---|---|" + "---:|" * (len(names) + 3))
    for fun in (rms_bwd, rms_bwd_rows, ln_bwd):
        for rows in args.rows:
            for dt in ("bfloat16", "float32"):
                x = inputs(rows, args.cols, dt)
                want = jax.jit(fun)(*x)
                fs = [jax.jit(fun), jaxstitch.jit(fun)]
                for spec in args.tune:
                    with bench._tuned(spec):
                        fs.append(jaxstitch.jit(fun))
                        jax.block_until_ready(fs[-1](*x))  # (planned at the first call, under the spec)
                for f in fs[1:]:
                    err = bench.max_rel_err(f(*x), want)
                    assert err < 2e-2, (fun.__name__, rows, dt, err)
                us = [statistics.median(one_call(f, x)[0] for _ in range(args.calls)) for f in fs]
                regions = [r for r in jaxstitch.explain(fun, *x).regions if r.stitched]
                roof = sum(r.est_bytes for r in regions) / bw * 1e6
                shape = ",".join(f"{r.grid}x{r.registers}" for r in regions) or "-"
                print(f"| {fun.__name__} | {rows} | {dt} | " + " | ".join(f"{u:.1f}" for u in us)
                      + f" | {roof:.1f} | {100 * roof / us[1]:.0f}% | {shape} |", flush=True)


if __name__ == "__main__":
    main()
