"""Why a model's step time differs between examples/train_harness.py and scripts/step_ab.py: the
same train step timed in one process, in turns, as each of them calls it, with one difference at a
time. For each variant and round it prints the wall time per step and the time the loop took to
hand all its steps to the runtime (dispatch): where dispatch is close to the wall time, the host,
not the GPU, sets the pace.

    python3 scripts/harness_probe.py --model dien [--rounds 5 --steps 24]

Variants (all donate the state):
  bound   : jit(partial(step, graphdef)), a new batch each step (train_harness.run's call)
  bound1  : the same, one batch for every step
  static  : jit(step, static_argnums=0), one batch (step_ab.py's call)
  staticN : the same, a new batch each step
then train_harness.run itself, once per compiler, for its own number.
"""
import argparse
import functools
import gc
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "examples")]

import jax  # noqa: E402

import jaxstitch  # noqa: E402
import train_harness  # noqa: E402
from example_models import load_example, model_arguments  # noqa: E402


def main():
    p = model_arguments(argparse.ArgumentParser())
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=24, help="steps per round")
    p.add_argument("--harness-steps", type=int, default=100, help="0: leave train_harness.run out")
    p.add_argument("--gc", choices=["on", "off"], default="on",
                   help="off: the garbage collector disabled while timing (as timeit does)")
    p.add_argument("--styles", nargs="*", default=["bound", "bound1", "static", "staticN"])
    p.add_argument("--harness-variants", type=int, default=0, metavar="REPEATS",
                   help="also train_harness.run's loop for jaxstitch.jit with one of its extras left out "
                        "at a time (lower + compile first; the losses kept), REPEATS times in turns")
    args = p.parse_args()
    example, init, make_batch = load_example(args)
    batches = jax.block_until_ready([make_batch(i) for i in range(args.steps)])
    step = example.train_step

    def prepare(jit, style):
        graphdef, state = init()
        if style.startswith("bound"):
            f = jit(functools.partial(step, graphdef), donate_argnums=(0,))
            call = lambda s, b: f(s, b)  # noqa: E731
        else:
            f = jit(step, static_argnums=(0,), donate_argnums=(1,))
            call = lambda s, b: f(graphdef, s, b)  # noqa: E731
        one = style in ("bound1", "static")
        for b in batches[:3]:
            _, state = call(state, b)
        jax.block_until_ready(state)
        return {"call": call, "state": state, "one": one, "wall": [], "dispatch": []}

    variants = {}
    for jname, jit in (("jax.jit", jax.jit), ("jaxstitch", jaxstitch.jit)):
        for style in args.styles:
            variants[f"{jname} {style}"] = prepare(jit, style)
    pauses = []  # (generation, ms) of every collection while timing
    start = {}

    def watch(phase, info):
        if phase == "start":
            start["t"] = time.perf_counter()
        else:
            pauses.append((info["generation"], (time.perf_counter() - start["t"]) * 1e3))

    gc.collect()
    gc.callbacks.append(watch)
    if args.gc == "off":
        gc.disable()
    for _ in range(args.rounds):
        for v in variants.values():
            state, call = v["state"], v["call"]
            t = time.perf_counter()
            for i in range(args.steps):
                _, state = call(state, batches[0] if v["one"] else batches[i])
            d = time.perf_counter()
            jax.block_until_ready(state)
            e = time.perf_counter()
            v["state"] = state
            v["wall"].append((e - t) * 1e3 / args.steps)
            v["dispatch"].append((d - t) * 1e3 / args.steps)
    gc.callbacks.remove(watch)
    gc.enable()
    full = [ms for g, ms in pauses if g == 2]
    print(f"{args.model} on {jax.devices()[0].device_kind}: ms per step, median of {args.rounds} rounds "
          f"of {args.steps} (range), and the dispatch loop's share; gc {args.gc}: {len(pauses)} "
          f"collections while timing, {len(full)} full ones ({sum(full):.0f} ms)")
    for name, v in variants.items():
        w, dsp = statistics.median(v["wall"]), statistics.median(v["dispatch"])
        print(f"  {name:20s} wall {w:7.2f} ({min(v['wall']):.2f}-{max(v['wall']):.2f})  "
              f"dispatch {dsp:7.2f}")
    variants.clear()
    for name, jit in (("jax.jit", jax.jit), ("jaxstitch.jit", jaxstitch.jit))[:2 if args.harness_steps else 0]:
        r = train_harness.run(name, jit, step, init, make_batch, args.harness_steps)
        print(f"  train_harness.run {name:14s} {r.step_ms:7.2f} ms/step")
    if args.harness_variants:
        many = jax.block_until_ready([make_batch(i) for i in range(args.harness_steps or 100)])
        times = {}
        for _ in range(args.harness_variants):
            for compile_first in (True, False):
                for keep in (True, False):
                    ms = harness_loop(jaxstitch.jit, step, init, many, compile_first, keep)
                    times.setdefault((compile_first, keep), []).append(ms)
        for (compile_first, keep), ms in times.items():
            print(f"  harness loop, lower+compile first {compile_first!s:5s} losses kept {keep!s:5s}: "
                  + " ".join(f"{m:.2f}" for m in ms) + " ms/step")


def harness_loop(jit, step, init, batches, compile_first, keep, warm=3):
    """train_harness.run's timed loop (collector off), with its extras optional."""
    graphdef, state = init()
    f = jit(functools.partial(step, graphdef), donate_argnums=(0,))
    if compile_first:
        f.lower(state, batches[0]).compile()
    for b in batches[:warm]:
        loss, state = f(state, b)
        float(loss)
    losses = []
    gc.collect()
    gc.disable()
    t = time.perf_counter()
    for b in batches[warm:]:
        loss, state = f(state, b)
        if keep:
            losses.append(loss)
    jax.block_until_ready((losses, state))
    ms = 1e3 * (time.perf_counter() - t) / (len(batches) - warm)
    gc.enable()
    return ms


if __name__ == "__main__":
    main()
