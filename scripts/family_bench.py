"""A shape family's kernels at the row counts a server sees: per-token statistics over a vocabulary
(a language model's log-softmax head), exported once with symbolic batch and sequence.

    python scripts/family_bench.py            # a GPU machine with torch (its CUPTI profiler)

Three programs, in this process on the same inputs: jax.jit compiled for each shape; the exported
family as jaxstitch plans it by default (its kernel, and for few long rows the ladder of split-row
variants the launcher picks by row count, or XLA's kernels below the row count where the cost
model expects those to win); the same without split variants (JAXSTITCH_TUNE=variants=0).
Times are GPU time per call (first kernel's start to last one's end, CUPTI, median of calls):
at these sizes a call's wall time is jax's dispatch, the same for all three. Table printed last.
"""
import os
import statistics
import sys
import time

os.environ.setdefault("JAXSTITCH_GUARD", "0")  # (the stitched program itself, not the guard's choice)

import torch  # noqa: F401  (first: device_time's CUPTI profiler shares its CUDA context with jax)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")]

import jaxstitch  # noqa: E402
from device_time import one_call  # noqa: E402
from test_families import token_stats  # noqa: E402

CASES = ((30522, (1, 8, 64, 512, 4096)),  # (and the rows either side of each variant's bound)
         (262144, (1, 2, 4, 8, 16, 17, 24, 32, 34, 40, 47, 64, 80, 96, 128, 512)))
CALLS = 7


def export(vocab: int, tune: str):
    os.environ["JAXSTITCH_TUNE"] = tune
    try:
        b, s = jax.export.symbolic_shape("b, s")
        spec = jax.ShapeDtypeStruct((b, s, vocab), jnp.float32)
        exp = jax.export.export(jaxstitch.jit(token_stats), platforms=["cuda"],
                                disabled_checks=jaxstitch.disabled_checks())(spec)
        (region,) = jaxstitch.explain(token_stats, spec).regions
    finally:
        del os.environ["JAXSTITCH_TUNE"]
    return jax.jit(exp.call), region


def gpu_us(f, x) -> float:
    return statistics.median(one_call(f, [x])[0] for _ in range(CALLS))


def main():
    rows_out = []
    for vocab, row_counts in CASES:
        one, region = export(vocab, "")
        plain, region_v = export(vocab, "variants=0")
        print(f"vocab {vocab}: {region.mapping}; default: {region.variants or 'no other'}; "
              f"without split variants: {region_v.variants or 'no other'}", flush=True)
        ref = jax.jit(token_stats)
        bounds = [int(v.split()[1]) for v in region.variants + region_v.variants]
        for rows in sorted(set(row_counts) | {r for b in bounds for r in (b - 1, b)}):
            x = jax.random.normal(jax.random.key(rows), (1, rows, vocab), jnp.float32) * 3
            for f in (one, plain):
                for g, w in zip(f(x), ref(x)):
                    assert float(jnp.max(jnp.abs(g - w))) < 1e-4 * (1 + float(jnp.max(jnp.abs(w))))
            us = [gpu_us(f, x) for f in (ref, one, plain)]
            rows_out.append((vocab, rows, *us))
            print(vocab, rows, [f"{u:.1f}" for u in us], flush=True)
    print(f"\n{jax.devices()[0].device_kind}, {time.strftime('%Y-%m-%d %H:%M')}, float32, GPU us per call "
          f"(CUPTI, median of {CALLS})")
    print("| vocab | rows | jax.jit | jaxstitch (default) | without split variants | default vs jax.jit "
          "| without vs jax.jit |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for v, r, a, b, c in rows_out:
        print(f"| {v} | {r} | {a:.1f} | {b:.1f} | {c:.1f} | {a / b:.2f}x | {a / c:.2f}x |")


if __name__ == "__main__":
    main()
