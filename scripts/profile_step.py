"""Where a train step's GPU time goes, jax.jit against jaxstitch.jit, from a CUPTI timeline (torch's
profiler, on the GPU machines only): per compiler, the step's span, the GPU's busy time, and the
kernels that take the most time, grouped by name.

    python3 scripts/profile_step.py [--dtype bfloat16] [--top 15]
"""
import argparse
import collections
import json
import os
import sys
import tempfile

import torch  # first: its CUDA context is the one jax then shares

torch.cuda.init()

import jax  # noqa: E402

import jaxstitch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import bert_train  # noqa: E402


def profile(f, graphdef, state, batch):
    for _ in range(3):
        _, state = f(graphdef, state, batch)
    jax.block_until_ready(state)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _, state = f(graphdef, state, batch)
        jax.block_until_ready(state)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = [e for e in json.load(fh)["traceEvents"] if e.get("cat") == "kernel"]
    return events


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="float32")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    import dataclasses
    c = dataclasses.replace(bert_train.Config(), dtype=args.dtype)
    init, batch = bert_train.make_init(c, 0), bert_train.make_batches(c, 0)
    for name, jit in (("jax.jit", jax.jit), ("jaxstitch.jit", jaxstitch.jit)):
        graphdef, state = init()
        f = jit(bert_train.train_step, static_argnums=(0,), donate_argnums=(1,))
        events = profile(f, graphdef, state, batch(0))
        start = min(e["ts"] for e in events)
        end = max(e["ts"] + e["dur"] for e in events)
        busy = sum(e["dur"] for e in events)
        by_name = collections.defaultdict(lambda: [0.0, 0])
        for e in events:
            key = e["name"][:70]
            by_name[key][0] += e["dur"]
            by_name[key][1] += 1
        print(f"\n{name}: span {end - start:.0f} us, GPU busy {busy:.0f} us, {len(events)} kernels")
        for key, (dur, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"  {dur:9.0f} us {n:5d}x  {key}")


if __name__ == "__main__":
    main()
