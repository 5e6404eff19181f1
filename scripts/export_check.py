"""Export a stitched function with symbolic batch and sequence on one machine, run it on another.

    python scripts/export_check.py export out/block.jax --target h100   # any machine, CPU-only too
    python scripts/export_check.py run out/block.jax                    # a GPU machine, fresh process

`run` deserializes the artifact (nothing is planned or compiled there: the cubins travel in it),
calls it at batch and sequence sizes never planned, compares with jax.jit of the same function and
prints one line per shape, then NVRTC's count in this process (0).
"""
import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxstitch
from jaxstitch.kernels import cache
from jaxstitch.bench.workloads import layernorm

HIDDEN = 768
SHAPES = ((1, 1), (1, 128), (3, 77), (8, 128), (32, 384), (64, 512))


def block(x, gamma, beta, h):
    """Post-attention pieces of an encoder layer: residual add, layer norm, bias-free GELU."""
    y = layernorm(x + h, gamma, beta)
    return y, jax.nn.gelu(y)


def specs(batch, seq, dtype=jnp.float32):
    return [jax.ShapeDtypeStruct((batch, seq, HIDDEN), dtype), jax.ShapeDtypeStruct((HIDDEN,), jnp.float32),
            jax.ShapeDtypeStruct((HIDDEN,), jnp.float32), jax.ShapeDtypeStruct((batch, seq, HIDDEN), dtype)]


def export(path: str, target: str | None):
    b, s = jax.export.symbolic_shape("b, s")
    exp = jax.export.export(
        jaxstitch.jit(block, target=target), platforms=["cuda"],
        disabled_checks=jaxstitch.disabled_checks())(*specs(b, s))
    with open(path, "wb") as f:
        f.write(exp.serialize())
    print(f"exported {path}: {exp.mlir_module().count('@jaxstitch_launch(')} stitched kernel call(s), "
          f"NVRTC compiles here: {cache.stats().nvrtc_compiles}")


def run(path: str):
    with open(path, "rb") as f:
        exp = jax.export.deserialize(bytearray(f.read()))
    call = jax.jit(exp.call)
    worst = 0.0
    for batch, seq in SHAPES:
        keys = jax.random.split(jax.random.key(batch * 1000 + seq), 4)
        args = [jax.random.normal(k, s.shape, s.dtype) for k, s in zip(keys, specs(batch, seq))]
        t0 = time.perf_counter()
        compiled = call.lower(*args).compile()
        got = jax.block_until_ready(compiled(*args))
        first = time.perf_counter() - t0
        assert "jaxstitch_launch" in compiled.as_text(), "the exported program lost its kernel"
        want = jax.jit(block)(*args)
        err = max(float(np.max(np.abs(np.asarray(g) - np.asarray(w)))) for g, w in zip(got, want))
        worst = max(worst, err)
        print(f"b={batch:3d} s={seq:4d}: max |exported - jax.jit| = {err:.2e}, first call {first * 1e3:.0f} ms")
    print(f"NVRTC compiles in this process: {cache.stats().nvrtc_compiles}; worst error {worst:.2e}")
    return 0 if worst < 1e-4 and cache.stats().nvrtc_compiles == 0 else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("action", choices=["export", "run"])
    p.add_argument("path")
    p.add_argument("--target", help="plan for this GPU (export on a machine without one)")
    a = p.parse_args()
    if a.action == "export":
        export(a.path, a.target)
        return 0
    return run(a.path)


if __name__ == "__main__":
    sys.exit(main())
