"""A train step under jax.jit and under jaxstitch.jit as planned and with JAXSTITCH_TUNE specs, timed
in turns in one process (wall clock per step, median over rounds): whether a planner change moves a
whole step, beyond run-to-run noise between processes.

    python3 scripts/step_ab.py --model bert --tune diamonds=0 [--rounds 7 --steps 10] [--gpu-time]

Rounds run with the garbage collector off (a full collection, ~0.1 s with JAX and a model loaded,
would land in one variant's round or another's by chance, as in train_harness.run); each round also
reports the host's dispatch time a step (the loop's steps handed to the runtime, before waiting):
where it reaches the step time, the host sets the pace, not the GPU. "alone" is the same for steps
handed over one at a time, each waited for: the host's time with no step in flight (XLA re-records a
command buffer whose buffers moved, which steps in flight can cause).

`--no-cmd-buffers` adds jax.jit and jaxstitch.jit compiled with
`compiler_options={"xla_gpu_enable_command_buffer": ""}`: every kernel launched on its own.

`--gpu-time` (GPU machines with torch) also records each round on a CUPTI timeline: the rounds' GPU
span and busy time a step, which host noise (a slow round by the wall clock) does not move unless the
GPU waits for the host.
"""
import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("JAXSTITCH_GUARD", "0")  # (the stitched program itself, not the guard's choice)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "examples")]
if "--gpu-time" in sys.argv:  # torch's CUPTI profiler, imported before jax (their CUDA context is shared)
    import device_time

import jax  # noqa: E402

import jaxstitch  # noqa: E402
import train_harness  # noqa: E402
from example_models import load_example, model_arguments  # noqa: E402


def main():
    p = model_arguments(argparse.ArgumentParser())
    p.add_argument("--tune", nargs="*", default=[], help="JAXSTITCH_TUNE specs, one variant each")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    p.add_argument("--gpu-time", action="store_true", help="also the GPU span and busy time a step (CUPTI)")
    p.add_argument("--no-cmd-buffers", action="store_true",
                   help="also jax.jit and jaxstitch.jit compiled without command buffers (CUDA graphs)")
    args = p.parse_args()
    example, init, batches = load_example(args)
    batch = batches(0)
    variants = [("jax.jit", jax.jit, None, {}), ("jaxstitch.jit", jaxstitch.jit, None, {})]
    variants += [(f"jaxstitch.jit {spec}", jaxstitch.jit, spec, {}) for spec in args.tune]
    if args.no_cmd_buffers:
        off = {"compiler_options": {"xla_gpu_enable_command_buffer": ""}}
        variants += [("jax.jit no cmd buffers", jax.jit, None, off),
                     ("jaxstitch.jit no cmd buffers", jaxstitch.jit, None, off)]
    runs = []
    for name, jit, spec, options in variants:
        t = time.perf_counter()
        graphdef, state = init()
        flat, state = train_harness.over_leaves(example.train_step, graphdef, state)
        f = jit(flat, donate_argnums=(0,), **options, **({"tuning": spec} if spec else {}))
        _, state = f(state, batch)  # (planned and compiled at the first call)
        jax.block_until_ready(state)
        print(f"  ({name}: first step, with tracing, planning and compiling, {time.perf_counter() - t:.1f} s)",
              flush=True)
        runs.append(Run(name, f, state))
    gc.collect()
    gc.disable()
    for _ in range(args.rounds):
        for run in runs:
            def steps(run=run):
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    _, run.state = run.f(run.state, batch)
                run.handed.append((time.perf_counter() - t0) * 1e3 / args.steps)
                jax.block_until_ready(run.state)

            t = time.perf_counter()
            if args.gpu_time:
                run.gpu.append(gpu_ms(device_time.gpu_events(steps), args.steps))
            else:
                steps()
            run.times.append((time.perf_counter() - t) * 1e3 / args.steps)
    for run in runs:  # one step in flight at a time: the host's own time to hand over a step
        for _ in range(args.steps):
            t0 = time.perf_counter()
            _, run.state = run.f(run.state, batch)
            run.alone.append((time.perf_counter() - t0) * 1e3)
            jax.block_until_ready(run.state)
    gc.enable()
    base = statistics.median(runs[0].times)
    shape = "".join(f" {name} {getattr(args, name)}" for name in ("seq", "batch") if getattr(args, name))
    print(f"{args.model} {args.dtype or 'float32'}{shape} on {jax.devices()[0].device_kind}: ms per step, "
          f"median of {args.rounds} rounds of {args.steps}"
          + (" (under the CUPTI profiler, which slows the host: compare only with --gpu-time runs)"
             if args.gpu_time else ""))
    for run in runs:
        ms = statistics.median(run.times)
        print(f"  {run.name:32s} {ms:8.2f} ms  {base / ms:5.3f}x  (rounds {min(run.times):.2f}-{max(run.times):.2f}; "
              f"dispatch {statistics.median(run.handed):.2f} ms, alone {statistics.median(run.alone):.2f} ms)")
    if args.gpu_time:
        base = statistics.median(s for s, _ in runs[0].gpu)
        print("GPU time a step (CUPTI: the round's span and its kernels' busy time, over its steps), median of rounds")
        for run in runs:
            spans = [s for s, _ in run.gpu]
            span, busy = statistics.median(spans), statistics.median(b for _, b in run.gpu)
            print(f"  {run.name:32s} span {span:8.2f} ms  {base / span:5.3f}x  busy {busy:8.2f} ms  "
                  f"(spans {min(spans):.2f}-{max(spans):.2f})")


@dataclasses.dataclass
class Run:
    """One variant: its jitted step over the state's leaves (train_harness.over_leaves), those
    leaves (donated each step), and what its rounds measured."""

    name: str
    f: Any
    state: Any
    times: list = dataclasses.field(default_factory=list)   # ms a step, a round each (wall clock)
    gpu: list = dataclasses.field(default_factory=list)     # (span, busy) ms a step, a round each (CUPTI)
    handed: list = dataclasses.field(default_factory=list)  # dispatch ms a step, a round each
    alone: list = dataclasses.field(default_factory=list)   # ms to hand over one step, nothing in flight


def gpu_ms(events: list[dict], steps: int) -> tuple[float, float]:
    """(span, busy) in ms a step of one round's GPU events."""
    if not events:
        return float("nan"), float("nan")
    busy = sum(e["dur"] for e in events if e["cat"] == "kernel")
    return device_time.span_us(events) / 1e3 / steps, busy / 1e3 / steps


if __name__ == "__main__":
    main()
