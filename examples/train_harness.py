"""What the training examples share: run one train step under jax.jit and under jaxstitch.jit from the
same seed, check the losses agree, time the steps and count the kernels of both executables.

A train step here is a pure function `step(graphdef, state, batch) -> (loss, new_state)` over an NNX
model and optimizer split into a static graph definition and a state of arrays (what `nnx.jit` does
inside); the state is donated, as in-place training expects. Both compilers get the same function.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import re
import statistics
import sys
import time
from typing import Callable

import jax
import numpy as np
from flax import nnx

import jaxstitch
from jaxstitch.bench.runner import count_collectives, count_kernels

GEMM = re.compile(r"__cublas|__cudnn|kind=kCustom|triton_gemm|cublas")


def nnx_train_step(loss: Callable) -> Callable:
    """The train step `step(graphdef, state, batch) -> (loss, new_state)` of an NNX (model,
    optimizer) pair that minimises `loss(model, batch)`."""
    def step(graphdef, state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        value, grads = nnx.value_and_grad(loss)(model, batch)
        optimizer.update(model, grads)
        return value, nnx.state((model, optimizer))
    return step


def over_leaves(step: Callable, graphdef, state) -> tuple[Callable, list]:
    """(`step` as `f(leaves, batch) -> (loss, new leaves)`, the state's leaves): the loop hands the
    compiled step a flat list of arrays, as a training loop that minds its host time does. An
    `nnx.State` is a pytree flattened and rebuilt in Python on every call: for BERT-base's state of
    655 arrays, 1.5 ms and 8.1 ms a call on a 2-core CPU, host time both compilers' steps would pay.
    The compiled program is the same."""
    leaves, treedef = jax.tree.flatten(state)

    def flat(leaves, batch):
        loss, new = step(graphdef, jax.tree.unflatten(treedef, leaves), batch)
        new_leaves, new_treedef = jax.tree.flatten(new)
        if new_treedef != treedef:
            raise ValueError(f"the train step's new state has another structure than its state: {new_treedef}")
        return loss, new_leaves

    return flat, leaves


def kernel_counts(hlo: str) -> tuple[int, int]:
    """(all launches, memory-intensive ones: all but matrix products) of a compiled HLO module."""
    total = count_kernels(hlo)
    gemms = sum(1 for line in hlo.splitlines() if " = " in line and GEMM.search(line)
                and ("custom-call(" in line or " fusion(" in line))
    return total, total - gemms


@dataclasses.dataclass
class Run:
    name: str
    losses: list[float]
    step_ms: float
    compile_s: float
    kernels: int | None
    memory_kernels: int | None
    collectives: dict | None = None
    host_ms: float | None = None  # the timed steps handed to the runtime, before waiting: a step
    # whose host_ms reaches its step_ms is paced by the host, not the GPU
    round_ms: list[float] = dataclasses.field(default_factory=list)  # ms a step in each timed round

    @property
    def spread_pct(self) -> float:
        """The rounds' range over their median: the run-to-run spread of the step time."""
        return 100 * (max(self.round_ms) - min(self.round_ms)) / self.step_ms if len(self.round_ms) > 1 else 0.0


def run(name: str, jit: Callable, step, init: Callable, batch: Callable, steps: int, warm: int = 3,
        place: Callable = lambda tree, kind: tree, rounds: int = 3) -> Run:
    """`steps` train steps from `init()` (graphdef, state) on `batch(i)`. After `warm` steps (the
    first compiles), the rest run in `rounds` rounds, each dispatched back to back, as a training
    loop does, and waited for at its end: a round's step time is its wall time over its steps (the
    host's dispatch overlaps the GPU's work), and the run's is the rounds' median, with their range
    as the spread. The garbage collector waits while they run, as under timeit. `place(tree,
    kind)` puts the state (kind "state") and each batch ("batch") on devices (examples/dp_train.py)."""
    graphdef, state = init()
    flat, state = over_leaves(step, graphdef, place(state, "state"))
    f = jit(flat, donate_argnums=(0,))
    batches = jax.block_until_ready([place(batch(i), "batch") for i in range(steps)])
    t0 = time.perf_counter()
    compiled = f.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    try:
        kernels, memory = kernel_counts(compiled.as_text())
    except ValueError:
        kernels = memory = None
    collectives = count_collectives(compiled.as_text())
    losses = []
    for b in batches[:warm]:
        loss, state = f(state, b)
        losses.append(float(loss))
    timed = batches[warm:]
    n_rounds = max(1, min(rounds, len(timed)))
    bounds = [round(i * len(timed) / n_rounds) for i in range(n_rounds + 1)]
    round_ms, host = [], []
    gc.collect()  # (as timeit does: a full collection, ~0.1 s with JAX loaded, would land in
    gc.disable()  # one compiler's timed steps or the other's by chance)
    try:
        for lo, hi in zip(bounds, bounds[1:]):
            t = time.perf_counter()
            for b in timed[lo:hi]:
                loss, state = f(state, b)
                losses.append(loss)
            host.append(1e3 * (time.perf_counter() - t) / max(1, hi - lo))
            jax.block_until_ready((losses, state))
            round_ms.append(1e3 * (time.perf_counter() - t) / max(1, hi - lo))
    finally:
        gc.enable()
    return Run(name, [float(x) for x in losses], statistics.median(round_ms), compile_s, kernels, memory,
               collectives, statistics.median(host), round_ms)


def loss_diff(losses, reference) -> float:
    """The largest relative difference between two runs' losses, step by step."""
    return max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses, reference))


# The examples compare our kernels' losses and step time with XLA's, so they run unguarded: the
# guard (jaxstitch/integration/guard.py) would run jax.jit's program where it measured ours slower.
UNGUARDED = functools.partial(jaxstitch.jit, guard=False)


def compare(title: str, step, init: Callable, batch: Callable, steps: int, rtol: float,
            json_path: str | None = None, stitch_jit: Callable = UNGUARDED) -> bool:
    """Both runs, their table, and whether the losses match step by step within `rtol`; with
    `json_path`, the same written as JSON (what scripts/plot_steps.py draws). `stitch_jit` lets a
    test plan for a named GPU on a CPU (`functools.partial(jaxstitch.jit, target="h100")`)."""
    runs = [run("jax.jit", jax.jit, step, init, batch, steps),
            run("jaxstitch.jit", stitch_jit, step, init, batch, steps)]
    ref, ours = runs
    diff = loss_diff(ours.losses, ref.losses)
    ok = diff <= rtol and all(np.isfinite(ours.losses))
    print(f"\n{title} on {jax.devices()[0].device_kind}, {steps} steps")
    print(f"{'':14s} {'step ms':>9s} {'spread':>7s} {'host ms':>8s} {'compile s':>10s} {'kernels':>8s} "
          f"{'memory-bound':>13s} {'loss[0]':>9s} {'loss[-1]':>9s}")
    for r in runs:
        k = "-" if r.kernels is None else str(r.kernels)
        m = "-" if r.memory_kernels is None else str(r.memory_kernels)
        print(f"{r.name:14s} {r.step_ms:9.2f} {r.spread_pct:6.1f}% {r.host_ms:8.2f} {r.compile_s:10.1f} {k:>8s} "
              f"{m:>13s} {r.losses[0]:9.4f} {r.losses[-1]:9.4f}")
    print(f"(step ms: the timed rounds' median ({len(ref.round_ms)} rounds), spread: their range over it; "
          "host ms: a step's dispatch by the host; where it reaches the step time, the host sets the pace)")
    print(f"speedup {ref.step_ms / ours.step_ms:.2f}x; losses: max relative difference {diff:.2e} over "
          f"{steps} steps ({'match' if ok else 'DIFFER'}, tolerance {rtol:g})")
    if json_path:
        record = {"title": title, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                  "date": datetime.datetime.now().isoformat(timespec="minutes"), "steps": steps,
                  "rtol": rtol, "max_loss_rel_diff": diff, "match": bool(ok),
                  "runs": [dataclasses.asdict(r) for r in runs]}
        with open(json_path, "w") as f:
            json.dump(record, f, indent=1)
    return ok


def main(title: str, example, args: argparse.Namespace, config) -> None:
    """An example's command line after parsing: `--explain` prints the plan of `example.train_step`
    for `config`, then both compilers train and the exit status says whether the losses matched
    (tolerance by the activations' dtype)."""
    init, batch = example.make_init(config, args.seed), example.make_batches(config, args.seed)
    if args.explain:
        graphdef, state = init()
        print(jaxstitch.explain(example.train_step, graphdef, state, batch(0), target="h100"))
    rtol = 2e-3 if getattr(config, "dtype", "float32") == "float32" else 2e-2
    ok = compare(f"{title} {config}", example.train_step, init, batch, args.steps, rtol=rtol,
                 json_path=args.json)
    sys.exit(0 if ok else 1)


def configured(args: argparse.Namespace, default, quick):
    """The example's config for its command line: `quick` under --quick, else `default`, with the
    --dtype, --seq and --batch given (attention's memory-bound share grows with the sequence)."""
    changes = {name: getattr(args, name) for name in ("dtype", "seq", "batch")
               if getattr(args, name, None) is not None}
    return dataclasses.replace(quick if args.quick else default, **changes)


def parser(description: str, dtype: bool = False) -> argparse.ArgumentParser:
    """The examples' shared options; `dtype` adds --dtype for the activations."""
    p = argparse.ArgumentParser(description=description)
    if dtype:
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                       help="activations (parameters and optimizer state stay float32)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the example's)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the example's)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--quick", action="store_true", help="a tiny model (CPU smoke run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--explain", action="store_true", help="print jaxstitch's plan for the train step")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    return p
