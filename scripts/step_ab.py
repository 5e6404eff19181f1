"""A train step under jax.jit and under jaxstitch.jit as planned and with JAXSTITCH_TUNE specs, timed
in turns in one process (wall clock per step, median over rounds): whether a planner change moves a
whole step, beyond run-to-run noise between processes.

    python3 scripts/step_ab.py --model bert --tune diamonds=0 [--rounds 7 --steps 10]
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "examples")]

import jax  # noqa: E402

import jaxstitch  # noqa: E402
from jaxstitch import bench  # noqa: E402
from example_models import load_example, model_arguments  # noqa: E402


def main():
    p = model_arguments(argparse.ArgumentParser())
    p.add_argument("--tune", nargs="*", default=[], help="JAXSTITCH_TUNE specs, one variant each")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    args = p.parse_args()
    example, init, batches = load_example(args)
    batch = batches(0)
    variants = [("jax.jit", jax.jit, None), ("jaxstitch.jit", jaxstitch.jit, None)]
    variants += [(f"jaxstitch.jit {spec}", jaxstitch.jit, spec) for spec in args.tune]
    runs = []
    for name, jit, spec in variants:
        graphdef, state = init()
        with bench._tuned(spec):  # (read by jaxstitch.jit; planned and compiled at the first call)
            f = jit(example.train_step, static_argnums=(0,), donate_argnums=(1,))
            _, state = f(graphdef, state, batch)
        jax.block_until_ready(state)
        runs.append([name, f, graphdef, state, []])
    for _ in range(args.rounds):
        for run in runs:
            _, f, graphdef, state, times = run
            t = time.perf_counter()
            for _ in range(args.steps):
                _, state = f(graphdef, state, batch)
            jax.block_until_ready(state)
            times.append((time.perf_counter() - t) * 1e3 / args.steps)
            run[3] = state
    base = statistics.median(runs[0][4])
    shape = "".join(f" {name} {getattr(args, name)}" for name in ("seq", "batch") if getattr(args, name))
    print(f"{args.model} {args.dtype or 'float32'}{shape} on {jax.devices()[0].device_kind}: ms per step, "
          f"median of {args.rounds} rounds of {args.steps}")
    for name, *_, times in runs:
        ms = statistics.median(times)
        print(f"  {name:32s} {ms:8.2f} ms  {base / ms:5.3f}x  (rounds {min(times):.2f}-{max(times):.2f})")


if __name__ == "__main__":
    main()
