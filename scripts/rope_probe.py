"""GPU time of GPT's rotary embedding alone (examples/gpt_train.py's `rotary` on queries of [8, 512,
12, 64], forward and fwd+bwd), jax.jit against jaxstitch.jit as planned and forced (paired halves,
plan/pairs.py): whether XLA's single kernel for it leaves anything to gain.

    python3 scripts/rope_probe.py
"""
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "examples")]

import device_time  # noqa: E402  (torch first: its CUDA context is the one jax shares)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxstitch  # noqa: E402
from jaxstitch import bench  # noqa: E402
from gpt_train import rotary  # noqa: E402


def fwd(q, positions):
    return rotary(q, positions, 10000.0)


def fwdbwd(q, positions, dy):
    out, vjp = jax.vjp(lambda q: rotary(q, positions, 10000.0), q)
    return out, vjp(dy)[0]


def main():
    key = jax.random.key(0)
    for dtype in (jnp.float32, jnp.bfloat16):
        q = jax.random.normal(key, (8, 512, 12, 64), dtype)
        positions = jnp.arange(512)
        for name, fn, args in (("fwd", fwd, (q, positions)), ("fwdbwd", fwdbwd, (q, positions, q * 0.5))):
            fns = {"jax.jit": jax.jit(fn), "planned": jaxstitch.jit(fn)}
            with bench._tuned("min_gain_pct=0"):
                fns["forced"] = jaxstitch.jit(fn)
            with bench._tuned("min_gain_pct=0,pairs=0"):
                fns["forced, pairs=0"] = jaxstitch.jit(fn)
            times = {k: statistics.median(device_time.one_call(f, args)[0] for _ in range(7)) for k, f in fns.items()}
            base = times["jax.jit"]
            print(f"rope {name} {jnp.dtype(dtype).name}: " + " | ".join(
                f"{k} {t:.1f} us ({base / t:.2f}x)" for k, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
