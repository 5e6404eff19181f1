"""Data-parallel training on the GPUs of one host, under jax.jit and jaxstitch.jit.

The model and optimizer state are replicated and each batch is split over a 1-D `data` mesh (a
`NamedSharding`), so XLA's SPMD partitioner runs the train step on every GPU and sums the gradients
with its collectives. jaxstitch's regions are planned again for each GPU's shard of the batch
(integration/spmd/). Runs the BERT (default) or GPT example's train step on 1 GPU and on N, from the same seed
and the same global batch, and prints step times, the speedup on each, the collectives in each
compiled program and how far the losses are from the 1-GPU jax.jit run.

    python examples/dp_train.py                       # BERT-base, 1 and all GPUs
    python examples/dp_train.py --model gpt --devices 2
    python examples/dp_train.py --quick --host-devices 4   # a tiny model on CPU "devices"
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def placer(devices):
    """`place(tree, kind)` for train_harness.run: state replicated, batches split on their first axis."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(devices), ("data",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def place(tree, kind):
        return jax.device_put(tree, replicated if kind == "state" else split)

    return place


def compare_devices(example, config, steps: int, counts, rtol: float, stitch_jit=None) -> tuple[bool, list]:
    """jax.jit and jaxstitch.jit train steps over the first n devices for each n in `counts`. Returns
    (losses all match the first jax.jit run and no program of ours has more collectives than
    jax.jit's, one row per n)."""
    import jax

    import jaxstitch
    import train_harness

    stitch_jit = stitch_jit or train_harness.UNGUARDED
    init, batch = example.make_init(config, 0), example.make_batches(config, 0)
    rows, ok, base = [], True, None
    for n in counts:
        place = placer(jax.devices()[:n])
        ref = train_harness.run("jax.jit", jax.jit, example.train_step, init, batch, steps, place=place)
        ours = train_harness.run("jaxstitch.jit", stitch_jit, example.train_step, init, batch, steps, place=place)
        base = base or ref.losses
        diff = max(train_harness.loss_diff(r.losses, base) for r in (ref, ours))
        fewer = all(ours.collectives[k] <= ref.collectives[k] for k in ref.collectives)
        ok = ok and diff <= rtol and fewer
        rows.append((n, ref, ours, diff, fewer))
    return ok, rows


def print_table(title: str, rows) -> None:
    import jax

    print(f"\n{title} on {jax.devices()[0].device_kind}")
    print(f"{'GPUs':>4s} {'jax.jit ms':>11s} {'jaxstitch ms':>13s} {'speedup':>8s} {'spread %':>11s} {'host ms':>13s} "
          f"{'collectives jax.jit':>20s} {'jaxstitch':>10s} {'memory-bound kernels':>21s} {'loss diff':>10s}")
    for n, ref, ours, diff, _ in rows:
        cr, co = (" ".join(f"{k[:6]}:{v}" for k, v in r.collectives.items() if v) or "-" for r in (ref, ours))
        kernels = f"{ref.memory_kernels} -> {ours.memory_kernels}"
        host = f"{ref.host_ms:.1f} / {ours.host_ms:.1f}"
        spread = f"{ref.spread_pct:.1f} / {ours.spread_pct:.1f}"  # (the timed rounds' range over their median)
        print(f"{n:4d} {ref.step_ms:11.2f} {ours.step_ms:13.2f} {ref.step_ms / ours.step_ms:7.2f}x {spread:>11s} {host:>13s} "
              f"{cr:>20s} {co:>10s} {kernels:>21s} {diff:10.2e}")
    if len(rows) > 1:
        first, last = (r[1].step_ms / r[2].step_ms for r in (rows[0], rows[-1]))
        print(f"speedup on {rows[-1][0]} GPUs is {100 * last / first:.0f}% of the speedup on {rows[0][0]}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bert", choices=["bert", "gpt"])
    p.add_argument("--devices", type=int, default=0, help="GPUs to split over (default: all)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--quick", action="store_true", help="a tiny model (runs anywhere)")
    p.add_argument("--host-devices", type=int, default=0, help="split the CPU into this many devices")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    if args.host_devices:  # (before JAX starts)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.host_devices}")
    import jax

    example = importlib.import_module(f"{args.model}_train")
    config = dataclasses.replace(example.QUICK if args.quick else example.Config(), dtype=args.dtype)
    n = args.devices or jax.device_count()
    rtol = 2e-3 if args.dtype == "float32" else 2e-2
    stitch_jit = None
    if jax.devices()[0].platform == "cpu":
        import functools

        import jaxstitch
        stitch_jit = functools.partial(jaxstitch.jit, target="h100")  # (plans for an H100, runs via XLA)
    ok, rows = compare_devices(example, config, args.steps, sorted({1, n}), rtol, stitch_jit)
    print_table(f"{args.model} data-parallel train step {config}", rows)
    print("losses match the 1-device jax.jit run and no extra collectives" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
