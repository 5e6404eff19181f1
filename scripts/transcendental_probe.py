"""Rows whose reductions read an expensive elementwise chain (tanh, erf, exp): XLA's one kernel
against ours, by GPU time, beside the cost model's estimates. XLA runs such a region as one kernel,
so the cost model expects ~1.06x and leaves it to XLA; fig7_chain in bfloat16 measured 1.28x
forced, with XLA at 72% of the roofline. Is the transcendental chain what slows XLA down?

    python3 scripts/transcendental_probe.py [--shape 32768,2048] [--calls 7]
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import device_time  # noqa: E402  (first: torch's CUDA context)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxstitch  # noqa: E402
from jaxstitch.bench import runner as bench  # noqa: E402
from jaxstitch.bench.workloads import fig7_chain  # noqa: E402

F32 = jnp.float32


def _ln(h, eps=1e-6):
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
    return (h - mean) * jax.lax.rsqrt(var + eps)


def fig7_exp(x, w):
    """fig7_chain with exp where it has tanh."""
    c = x.shape[-1]
    a = jnp.exp(x.astype(F32)) * w.astype(F32)
    t = jnp.exp(-jnp.sum(a, axis=-1) / c)
    y = a * t[:, None]
    return (y - jnp.max(y, axis=-1)[:, None]).astype(x.dtype)


def ln_gelu_erf(x, w):
    """BERT's prediction-head transform after its matrix product: exact GELU, then layernorm."""
    return (_ln(jax.nn.gelu(x.astype(F32), approximate=False)) * w.astype(F32)).astype(x.dtype)


def ln_gelu_tanh(x, w):
    """The same with the tanh GELU."""
    return (_ln(jax.nn.gelu(x.astype(F32), approximate=True)) * w.astype(F32)).astype(x.dtype)


def softcap_softmax(x, w):
    """Logit soft-capping (Gemma 2: cap * tanh(x / cap)) before a softmax."""
    z = 30.0 * jnp.tanh(x.astype(F32) * w.astype(F32) / 30.0)
    return jax.nn.softmax(z, axis=-1).astype(x.dtype)


def plain_ln(x, w):
    """A layernorm alone (no expensive chain): the control."""
    return (_ln(x.astype(F32)) * w.astype(F32)).astype(x.dtype)


CASES = {f.__name__: f for f in (fig7_chain, fig7_exp, ln_gelu_erf, ln_gelu_tanh, softcap_softmax, plain_ln)}


def estimates(fn, args, tune=None):
    """(stitched?, our estimate µs, XLA's estimate µs) of the one region."""
    r = jaxstitch.explain(fn, *args, tuning=tune).regions[0]
    return r.stitched, r.est_us, r.xla_est_us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="32768,2048")
    ap.add_argument("--calls", type=int, default=7)
    ap.add_argument("--only", nargs="*", default=list(CASES))
    ap.add_argument("--hlo", action="store_true", help="also print XLA's fusions (compiled HLO)")
    opts = ap.parse_args()
    n, c = map(int, opts.shape.split(","))
    bandwidth = bench.measure_bandwidth(False, 10)
    print(f"device: {jax.devices()[0].device_kind} | copy bandwidth {bandwidth / 1e9:.0f} GB/s | "
          f"[{n}, {c}] | GPU µs (CUPTI), median of {opts.calls}")
    print("| case | dtype | XLA µs (kernels) | XLA % roofline | XLA est | ours forced µs | ours est | forced / XLA "
          "| planned | max rel err |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
    forced = "min_gain_pct=100"
    for name in opts.only:
        fn = CASES[name]
        for dtype in (jnp.float32, jnp.bfloat16):
            kx, kw = jax.random.split(jax.random.key(1))
            args = (jax.random.normal(kx, (n, c), dtype), 1.0 + 0.1 * jax.random.normal(kw, (c,), dtype))
            xla = jax.jit(fn)
            ours = jaxstitch.jit(fn, tuning=forced)
            want = jax.block_until_ready(xla(*args))
            err = bench.max_rel_err(jax.block_until_ready(ours(*args)), want)
            xla_calls = [device_time.one_call(xla, args) for _ in range(opts.calls)]
            xs, xk = statistics.median(t for t, _ in xla_calls), statistics.median(k for _, k in xla_calls)
            ss = statistics.median(device_time.one_call(ours, args)[0] for _ in range(opts.calls))
            planned, _, _ = estimates(fn, args)
            _, our_est, xla_est = estimates(fn, args, forced)
            ideal = (bench.tree_bytes(args) + bench.tree_bytes(want)) / bandwidth * 1e6
            print(f"| {name} | {jnp.dtype(dtype).name} | {xs:.1f} ({xk:.0f}) | {100 * ideal / xs:.0f}% | {xla_est:.1f} | "
                  f"{ss:.1f} | {our_est:.1f} | {xs / ss:.2f}x | {'stitched' if planned else 'XLA'} | "
                  f"{err:.1e} |", flush=True)
            if opts.hlo:
                hlo = xla.lower(*args).compile().as_text()
                print("\n".join("    " + line.strip()[:160] for line in hlo.splitlines()
                                if "fusion(" in line and "ENTRY" not in line or "__triton" in line))


if __name__ == "__main__":
    main()
