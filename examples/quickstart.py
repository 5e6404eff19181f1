"""jaxstitch in one page: a layernorm forward + backward, stitched into one kernel.

On a machine with an NVIDIA GPU the stitched version runs our kernel; elsewhere jaxstitch.jit is
jax.jit (it says so in the log) and the plan below is made for an H100 all the same.
"""
import logging
import time

import jax
import jax.numpy as jnp

import jaxstitch

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
logging.getLogger("jax").setLevel(logging.WARNING)


def layernorm(x, gamma, beta):
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = ((xf - mean) ** 2).mean(-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + 1e-5) * gamma + beta).astype(x.dtype)


def fwd_bwd(x, gamma, beta, dy):
    y, vjp = jax.vjp(layernorm, x, gamma, beta)
    return (y, *vjp(dy))


def timed(f, args, reps=20):
    jax.block_until_ready(f(*args))
    start = time.perf_counter()
    for _ in range(reps):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps * 1e6


def main():
    on_gpu = jaxstitch.targets.detect() is not None
    rows, cols = (16384, 1024) if on_gpu else (512, 1024)
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (rows, cols), jnp.bfloat16)
    gamma = 1 + 0.1 * jax.random.normal(keys[1], (cols,), jnp.bfloat16)
    beta = 0.1 * jax.random.normal(keys[2], (cols,), jnp.bfloat16)
    dy = jax.random.normal(keys[3], (rows, cols), jnp.bfloat16)
    args = (x, gamma, beta, dy)

    print(jaxstitch.explain(fwd_bwd, *args, target=None if on_gpu else "h100"))
    ref = jax.jit(fwd_bwd)(*args)
    out = jaxstitch.jit(fwd_bwd)(*args)
    err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
              for a, b in zip(ref, out))
    print(f"max abs difference from jax.jit: {err:.3g}")
    if on_gpu:
        t_jit, t_stitch = timed(jax.jit(fwd_bwd), args), timed(jaxstitch.jit(fwd_bwd), args)
        print(f"jax.jit {t_jit:.1f} us, jaxstitch.jit {t_stitch:.1f} us: {t_jit / t_stitch:.2f}x")
    else:
        print("no CUDA GPU here: jaxstitch.jit ran as jax.jit; the plan above is what an H100 would run")


if __name__ == "__main__":
    main()
