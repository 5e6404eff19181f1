"""The host's share of a call: per-call wall time of back-to-back calls, jax.jit against
jaxstitch.jit, and the time the loop takes to hand them to the runtime (enqueue). Where the two are
equal the host sets the pace, not the GPU; compare with scripts/device_time.py's GPU time.

    python3 scripts/dispatch_probe.py layernorm_fwdbwd_short:bfloat16:full softmax_fwd:float32:quick
"""
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import jaxstitch
from jaxstitch import workloads

CALLS = 400


def per_call_us(f, args) -> tuple[float, float]:
    """(wall µs a call, median of 5 loops; enqueue µs a call, one loop) of CALLS calls in a row."""
    jax.block_until_ready(f(*args))
    walls = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            out = f(*args)
        jax.block_until_ready(out)
        walls.append((time.perf_counter() - t0) / CALLS * 1e6)
    t0 = time.perf_counter()
    for _ in range(CALLS):
        out = f(*args)
    enqueue = (time.perf_counter() - t0) / CALLS * 1e6
    jax.block_until_ready(out)
    return statistics.median(walls), enqueue


def main(specs):
    for spec in specs:
        name, dtype, size = spec.split(":")
        w = workloads.WORKLOADS[name]
        args = w.make_inputs(jax.random.key(0), getattr(jnp, dtype), size == "quick")
        res = {label: per_call_us(f, args) for label, f in (("jax.jit", jax.jit(w.fn)),
                                                              ("jaxstitch", jaxstitch.jit(w.fn)))}
        print(f"{name} {dtype} {size}: " + "; ".join(
            f"{k} {wall:.1f} us/call (enqueue {enq:.1f})" for k, (wall, enq) in res.items()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["softmax_fwd:float32:quick"])
