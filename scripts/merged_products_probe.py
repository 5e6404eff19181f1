"""The SwiGLU MLP's gradients at GPT's shapes (x [4096, 768] bfloat16), GPU span of one call (CUPTI,
median of 7) and its largest kernels: jax.jit, then jaxstitch.jit with the products as written and
merged over concatenations (merged_products.py), each as planned and with every region forced ours.
Measured (H100): 314 / 311 / 324 (merged, XLA writing [dg | du]) / 286 us (merged, forced).

    python3 scripts/merged_products_probe.py   (GPU machines with torch)
"""
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests")]
from device_time import call_gpu_events, span_us  # noqa: E402  (first: torch's CUDA context is the one jax shares)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxstitch  # noqa: E402
from jaxstitch.bench import _tuned, max_rel_err  # noqa: E402
from strategies import force_stitching, random_inputs  # noqa: E402
from test_merged_products import swiglu_grads  # noqa: E402

S = jax.ShapeDtypeStruct
SPECS = [S((4096, 768), jnp.bfloat16), S((768, 2048), jnp.float32), S((768, 2048), jnp.float32),
         S((2048, 768), jnp.float32)]


def report(name, f, args, want):
    spans = []
    for _ in range(7):
        events = call_gpu_events(f, args)
        spans.append(span_us(events))
    largest = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: -e["dur"])[:9]
    print(f"{name:40s} {statistics.median(spans):8.1f} us  max rel err {max_rel_err(f(*args), want):.1e}  "
          + ", ".join(f"{e['name'][:28]} {e['dur']:.0f}" for e in largest), flush=True)


def main():
    args = random_inputs(SPECS, 1)
    want = jax.jit(swiglu_grads)(*args)
    report("jax.jit", jax.jit(swiglu_grads), args, want)
    for tune in ("merge_products=0", "merge_products=1"):
        for forced in (False, True):
            with _tuned(tune):
                f = jaxstitch.jit(swiglu_grads)
                if forced:
                    with force_stitching():
                        jax.block_until_ready(f(*args))
                else:
                    jax.block_until_ready(f(*args))
            report(tune + (", every region forced" if forced else ""), f, args, want)


if __name__ == "__main__":
    main()
