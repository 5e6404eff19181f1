"""The kernels one call of a suite workload runs, with their GPU time (CUPTI), under jax.jit and
under jaxstitch.jit: which of a stitched program's kernels are ours and which XLA's.

    python3 scripts/region_kernels.py xent_labels_fwdbwd float32 [--quick]
"""
import collections
import sys

from device_time import gpu_events  # (first: torch's CUDA context is the one jax shares)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxstitch  # noqa: E402
from jaxstitch.bench.workloads import WORKLOADS  # noqa: E402


def main():
    name, dtype = sys.argv[1], jnp.dtype(sys.argv[2] if len(sys.argv) > 2 else "float32")
    w = WORKLOADS[name]
    args = w.make_inputs(jax.random.key(0), dtype, "--quick" in sys.argv)
    for label, f in (("jax.jit", jax.jit(w.fn)), ("jaxstitch.jit", jaxstitch.jit(w.fn))):
        for _ in range(3):
            jax.block_until_ready(f(*args))
        events = gpu_events(lambda: jax.block_until_ready(f(*args)))
        by_name = collections.defaultdict(list)
        for e in events:
            by_name[e["name"][:90]].append(e["dur"])
        print(f"{label}: {len(events)} GPU events, {sum(e['dur'] for e in events):.1f} us busy")
        for n, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {sum(durs):8.1f} us  x{len(durs)}  {n}")


if __name__ == "__main__":
    main()
