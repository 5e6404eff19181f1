"""GPU time per call of host-bound workloads, jax.jit against jaxstitch.jit, from a CUPTI timeline.

AdamW over BERT-base passes 1,394 buffers in and 597 out: a call's wall time is jax's dispatch of
them (3-6 ms), for jax.jit as for us, while the GPU is busy for about 1 ms. Inside a training step
the update is one part of a single jitted call, so its GPU time is what counts. This reads it off
torch's CUPTI profiler (on the GPU machines, not a jaxstitch dependency): per call, the span from
the first kernel's start to the last one's end, and the kernels in it; medians over calls.

    python3 scripts/device_time.py [--calls 7] [--only adamw_bert | --all] [--quick]
        [--dtype bfloat16] [--shape 16,262144] [--tune "stages=2" ...] [--events]

Any call shorter than the host's dispatch of it (30-60 µs a call on the GPU machines, for jax.jit as
for us) is timed by the benchmark's back-to-back loop as host time; its GPU span is what the
kernels take. `--tune SPEC...` times stitched variants planned with JAXSTITCH_TUNE=SPEC on GPU
time too (the benchmark's own `--tune` compares wall times).
"""
import argparse
import json
import os
import statistics
import tempfile

os.environ.setdefault("JAXSTITCH_GUARD", "0")  # (the stitched program itself, not the guard's choice)

import torch  # first: its CUDA context is the one jax then shares

torch.cuda.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxstitch  # noqa: E402
from jaxstitch.bench import runner as bench  # noqa: E402
from jaxstitch.bench.workloads import WORKLOADS  # noqa: E402

HOST_BOUND = ("adamw_bert",)
GPU_EVENTS = ("kernel", "gpu_memset", "gpu_memcpy")


def gpu_events(run, cats=GPU_EVENTS) -> list[dict]:
    """The GPU events (kernels, memsets, copies) CUPTI records while `run()` executes, as chrome
    trace events (`cat`, `name`, `ts` and `dur` in µs); `cats=None` keeps every category (the host's
    CUDA API calls too)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and (cats is None or e.get("cat") in cats)]


def call_gpu_events(f, args) -> list[dict]:
    """One call's GPU events in start order, the GPU idle before it (after a call of its own)."""
    jax.block_until_ready(f(*args))
    return sorted(gpu_events(lambda: jax.block_until_ready(f(*args))), key=lambda e: e["ts"])


def span_us(events: list[dict]) -> float:
    """First event's start to last event's end, in µs (nan without events)."""
    if not events:
        return float("nan")
    return max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)


def one_call(f, args) -> tuple[float, int]:
    """(span µs, kernels) of one call, the GPU idle before it."""
    ev = call_gpu_events(f, args)
    return span_us(ev), sum(e.get("cat") == "kernel" for e in ev)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=7)
    ap.add_argument("--only", nargs="*", default=list(HOST_BOUND))
    ap.add_argument("--all", action="store_true", help="every workload of the suite")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "all"], default="all")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shape", help="draw the inputs at this main shape (e.g. 16,262144) instead of the "
                    "workload's own")
    ap.add_argument("--tune", nargs="+", metavar="SPEC", default=[],
                    help='also time stitched variants planned with JAXSTITCH_TUNE=SPEC')
    ap.add_argument("--events", action="store_true",
                    help="also list one stitched call's GPU events (start offset, duration): gaps "
                    "where the GPU waited for the host show there")
    opts = ap.parse_args()
    names = list(WORKLOADS) if opts.all else opts.only
    dtypes = ("float32", "bfloat16") if opts.dtype == "all" else (opts.dtype,)
    variants = []
    bandwidth = bench.measure_bandwidth(opts.quick, 10)
    print(f"device: {jax.devices()[0].device_kind} | copy bandwidth {bandwidth / 1e9:.0f} GB/s | "
          f"GPU span per call (CUPTI), median of {opts.calls}")
    print("| workload | dtype | jax.jit GPU µs | jaxstitch GPU µs | speedup | jax.jit+Triton GPU µs | "
          "% roofline (stitch) | % roofline (jit) | kernels (jit→stitch) | max rel err |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        w = WORKLOADS[name]
        for dtype in dtypes:
            if opts.shape:
                args = w.draw(jax.random.key(0), getattr(jnp, dtype), *map(int, opts.shape.split(",")))
            else:
                args = w.make_inputs(jax.random.key(0), getattr(jnp, dtype), opts.quick)
            fns = (jax.jit(w.fn), jaxstitch.jit(w.fn))
            want = jax.block_until_ready(fns[0](*args))
            err = bench.max_rel_err(jax.block_until_ready(fns[1](*args)), want)
            moved = bench.tree_bytes(args) + bench.tree_bytes(want)
            triton = bench._xla_triton(w.fn, args)  # (the strongest XLA: bench.XLA_TRITON)
            res = []
            for f in fns + ((triton,) if triton else ()):
                calls = [one_call(f, args) for _ in range(opts.calls)]
                res.append((statistics.median(c[0] for c in calls), statistics.median(c[1] for c in calls)))
            (xs, xk), (ss, sk) = res[:2]
            ts = f"{res[2][0]:.1f}" if triton else "-"
            ideal = moved / bandwidth * 1e6
            label = f"{name} {opts.shape}" if opts.shape else name
            print(f"| {label} | {dtype} | {xs:.1f} | {ss:.1f} | {xs / ss:.2f}x | {ts} | {100 * ideal / ss:.0f}% | "
                  f"{100 * ideal / xs:.0f}% | {xk:.0f}→{sk:.0f} | {err:.1e} |", flush=True)
            timed = []
            for spec in opts.tune:
                f = jaxstitch.jit(w.fn, tuning=spec)
                vs = statistics.median(one_call(f, args)[0] for _ in range(opts.calls))
                timed.append(f"{spec}: {vs:.1f} ({ss / vs:.2f}x, {100 * ideal / vs:.0f}%)")
            if timed:
                variants.append(f"  {label} {dtype}: default {ss:.1f} | " + " | ".join(timed))
            if opts.events:
                variants.append(f"  {label} {dtype}, one stitched call's events (+start µs, µs, name):")
                ev = call_gpu_events(fns[1], args)
                variants += [f"    +{e['ts'] - ev[0]['ts']:9.1f} {e['dur']:9.1f} {e['name'][:60]}" for e in ev]
    if variants:
        print("\nvariants (GPU µs; x = default / variant, >1 means the variant is faster) and events")
        print("\n".join(variants))


if __name__ == "__main__":
    main()
