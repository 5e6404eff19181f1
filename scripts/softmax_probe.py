"""Attention-shaped softmaxes, plain and causal (a mask from iotas), forward and backward (GPT's
attention gradient from the saved probabilities: y * (dy - sum(dy * y)), masked, scaled), jax.jit against
jaxstitch.jit as planned and forced (JAXSTITCH_TUNE=min_gain_pct=0): GPU time per call (CUPTI span,
median of calls), to check the cost model's estimate of XLA's one kernel against what it measures.

    python scripts/softmax_probe.py [function names]
"""
import os
import statistics
import sys

import torch  # noqa: F401  (first: device_time's CUPTI profiler shares its CUDA context with jax)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests")]

import jaxstitch  # noqa: E402
from device_time import one_call  # noqa: E402
from jaxstitch.bench import runner as bench  # noqa: E402
from test_views import causal_softmax  # noqa: E402


def plain_softmax(x):
    return jax.nn.softmax(x * 0.125, axis=-1)


def _masked_bwd(y, dy, mask):
    dx = y * (dy - jnp.sum(dy * y, axis=-1, keepdims=True))
    return jnp.where(mask, dx, 0.0) / 8.0


def plain_softmax_bwd(y, dy):
    return _masked_bwd(y, dy, True)


def causal_softmax_bwd(y, dy):
    s = y.shape[-1]
    return _masked_bwd(y, dy, jnp.tril(jnp.ones((s, s), bool)))


SHAPES = [(32, 12, 128, 128), (8, 12, 512, 512), (2, 12, 2048, 2048)]


def main():
    print("| function | shape | dtype | jax.jit us | jaxstitch us | forced us | XLA est. us | ours est. us | stitched |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    funs = [plain_softmax, causal_softmax, plain_softmax_bwd, causal_softmax_bwd]
    only = sys.argv[1:]
    for fun in (f for f in funs if not only or f.__name__ in only):
        for shape in SHAPES:
            for dt in ("float32", "bfloat16"):
                keys = jax.random.split(jax.random.key(0), 2)
                x = [(jax.random.normal(k, shape) * 3).astype(dt) for k in keys]
                x = x[:fun.__code__.co_argcount]
                (r,) = jaxstitch.explain(fun, *x).regions
                fs = [jax.jit(fun), jaxstitch.jit(fun)]
                fs.append(jaxstitch.jit(fun, tuning="min_gain_pct=0"))
                for f in fs[1:]:
                    assert bench.max_rel_err(f(*x), fs[0](*x)) < 1e-2
                us = [statistics.median(one_call(f, x)[0] for _ in range(7)) for f in fs]
                print(f"| {fun.__name__} | {shape} | {dt} | " + " | ".join(f"{u:.1f}" for u in us)
                      + f" | {r.xla_est_us:.1f} | {r.est_us:.1f} | {r.stitched} |", flush=True)


if __name__ == "__main__":
    main()
