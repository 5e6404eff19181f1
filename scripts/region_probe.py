"""Each kind of region of a train step, timed alone: XLA's kernels for it (jax.jit of the region's
equations) against ours forced (JAXSTITCH_TUNE=min_gain_pct=0), GPU time per call by CUPTI, beside
the cost model's two estimates. It finds regions the model misjudges, such as a softmax
backward (XLA's "one kernel" was two: plan/diamonds.py). A region alone is not the region in its
step: XLA may fuse across its edges there. So a finding is a lead to check on the whole step
(scripts/step_ab.py), not a result.

    python3 scripts/region_probe.py --model gpt [--dtype bfloat16] [--top 12] [--declined]

Without a GPU (`--target h100`) it plans, replays each region through XLA on the CPU and prints the
estimates only: a check that the replays run.
"""
import argparse
import collections
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "examples")]

TIMING = "--target" not in sys.argv
if TIMING:  # on a GPU: torch's CUPTI profiler, imported before jax (their CUDA context is shared)
    import device_time

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxstitch  # noqa: E402
from example_models import load_example, model_arguments  # noqa: E402
from jaxstitch import api, bench, config, families, trace as trace_mod  # noqa: E402


def regions_with_traces(program, where=""):
    """(where, traced program the region belongs to, Compiled) for the program's regions and its
    bodies'."""
    for c in program.regions:
        yield where, program.traced, c
    for i, (name, _), body in program.bodies:
        label = program.traced.eqns[i].primitive.name + ("" if name == "jaxpr" else f".{name}")
        yield from regions_with_traces(body, f"{where}/{label}" if where else label)


def kind(c) -> tuple:
    """Regions alike: the same ops on the same shapes."""
    r = c.plan.region
    return (tuple(op.prim for op in r.ops), tuple((v.shape, v.dtype) for v in (*r.inputs, *r.outputs)))


def replay(traced, region):
    """The region's equations as a function of its inputs (what XLA runs when it is not stitched)."""
    eqns = [traced.eqns[op.index] for op in region.ops]

    def fn(*args):
        return trace_mod.evaluate(eqns, region.inputs, args, region.outputs, traced.consts)

    return fn


def inputs(region, seed: int):
    """Random inputs: normal floats, small non-negative integers (indices, counts), random bools."""
    rng = np.random.default_rng(seed)
    out = []
    for v in region.inputs:
        if v.dtype == "bool":
            out.append(jnp.asarray(rng.random(v.shape) < 0.5))
        elif v.dtype.startswith(("int", "uint")):
            out.append(jnp.asarray(rng.integers(0, 8, v.shape), dtype=v.dtype))
        else:
            out.append(jnp.asarray(rng.standard_normal(v.shape), dtype=jnp.dtype(v.dtype)))
    return out


def main():
    p = model_arguments(argparse.ArgumentParser())
    p.add_argument("--top", type=int, default=12, help="kinds of region, by XLA's estimated time a step")
    p.add_argument("--declined", action="store_true", help="only regions the cost model leaves to XLA")
    p.add_argument("--target", default=None, help="plan for this GPU and only check the replays (no GPU)")
    p.add_argument("--calls", type=int, default=7)
    args = p.parse_args()
    example, init, batches = load_example(args)
    graphdef, state = init()
    target = jaxstitch.get_target(args.target) if args.target else jaxstitch.targets.detect()
    dyn, static, tree = api._split_dynamic((graphdef, state, batches(0)), {})
    program = families.build_any(example.train_step, dyn, tree, target, config.load(), static)

    groups = collections.defaultdict(list)
    for where, traced, c in regions_with_traces(program):
        if c.plan.estimate is not None and not (args.declined and c.stitched):
            groups[kind(c)].append((where, traced, c))
    ranked = sorted(groups.values(), key=lambda g: -len(g) * g[0][2].plan.estimate.xla_us)[:args.top]

    print(f"{args.model} {args.dtype or 'float32'} on {target.name}: per region kind, us a call"
          + ("" if TIMING else " (estimates only: no GPU)"))
    print("| n | where | stitched | ops | XLA est. | ours est. | jax.jit | forced | measured / est. ratio "
          "| max rel err |")
    print("|---:|---|---|---|---:|---:|---:|---:|---|---:|")
    for group in ranked:
        where, traced, c = group[0]
        est = c.plan.estimate
        fn = replay(traced, c.plan.region)
        x = inputs(c.plan.region, 0)
        if TIMING:
            xla_f = jax.jit(fn)
            with bench._tuned("min_gain_pct=0"):  # (read when the wrapper is made)
                ours_f = jaxstitch.jit(fn)
            err = bench.max_rel_err(ours_f(*x), xla_f(*x))  # (random inputs: NaN where both log a negative)
            us = [statistics.median(device_time.one_call(f, x)[0] for _ in range(args.calls))
                  for f in (xla_f, ours_f)]
            measured = f"{us[0]:.1f} | {us[1]:.1f} | {us[0] / us[1]:.2f} / {est.speedup:.2f} | {err:.1e}"
        else:
            jax.block_until_ready(jax.jit(fn)(*x))
            measured = "- | - | - | -"
        ops = ",".join(sorted(set(op.prim for op in c.plan.region.ops)))[:60]
        print(f"| {len(group)} | {where or 'step'} | {c.stitched} | {ops} | {est.xla_us:.1f} | {est.us:.1f} "
              f"| {measured} |", flush=True)


if __name__ == "__main__":
    main()
