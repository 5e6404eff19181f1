"""Does the order of a weight gradient's operands change cuBLAS's speed, with nothing to fuse?

BERT's MLP fc2 weight gradient, dW = h^T dy over the batch and sequence axes, ran on a slower cuBLAS
kernel under jaxstitch than under jax.jit, where XLA's Triton gemm rewriter fuses dy's producer and
then swaps the dot's operands (docs/perf_notes.md). This times jax.jit alone on the same
product written four ways (as written, operands swapped and transposed back, swapped and left
[H, F], and with a fusable producer of dy), at BERT-base's shape, float32.

    python3 scripts/gemm_order_probe.py
"""
import jax
import jax.numpy as jnp

from jaxstitch import bench

B, S, F, H = 32, 128, 3072, 768
DN = (((0, 1), (0, 1)), ((), ()))  # contract batch and sequence


def main():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(k1, (B, S, F), jnp.float32)
    dy = jax.random.normal(k2, (B, S, H), jnp.float32)
    m = jax.random.bernoulli(k3, 0.9, (B, S, H)).astype(jnp.float32)
    variants = {
        "as written": lambda h, dy, m: jax.lax.dot_general(h, dy, DN),
        "swapped, transposed back": lambda h, dy, m: jax.lax.dot_general(dy, h, DN).T,
        "swapped, left [H, F]": lambda h, dy, m: jax.lax.dot_general(dy, h, DN),
        "dy's producer fusable": lambda h, dy, m: jax.lax.dot_general(h, dy * m * 1.1, DN),
    }
    for name, fn in variants.items():
        f = jax.jit(fn)
        args = (h, dy, m)
        us = bench.time_fn(f, args, 15, bench.pick_inner(f, args))
        hlo = f.lower(*args).compile().as_text()
        print(f"{name:26s} {us:7.1f} us  kernels {bench.count_kernels(hlo)}")


if __name__ == "__main__":
    main()
