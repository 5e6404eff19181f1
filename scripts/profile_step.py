"""Where a train step's GPU time goes, jax.jit against jaxstitch.jit, from a CUPTI timeline (torch's
profiler, on the GPU machines only): per compiler, the step's span, the GPU's busy time split into
matrix products, our kernels and XLA's other kernels, and the kernels that take the most time,
grouped by name. For jaxstitch.jit also the busy time its partition would give with every stitched
kernel at the HBM roofline: the ceiling of the step's speedup while the regions stay as they are.

    python3 scripts/profile_step.py [--model bert|gpt|dien] [--dtype bfloat16] [--top 15] [--tune SPEC ...]

`--tune` also profiles jaxstitch.jit with each JAXSTITCH_TUNE spec.
"""
import argparse
import collections
import math
import os
import sys

os.environ.setdefault("JAXSTITCH_GUARD", "0")  # (the stitched program itself, not the guard's choice)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "examples")]
from device_time import GPU_EVENTS, gpu_events, span_us  # noqa: E402  (first: torch's CUDA context is the one jax shares)

import jax  # noqa: E402

import jaxstitch  # noqa: E402
from jaxstitch.bench import runner as bench  # noqa: E402
from jaxstitch.targets import TARGETS
from jaxstitch.integration.devices import detect  # noqa: E402
from example_models import load_example, model_arguments  # noqa: E402


def profile(f, graphdef, state, batch):
    """All CUPTI events of one warm step (GPU work and the host's CUDA calls)."""
    for _ in range(3):
        _, state = f(graphdef, state, batch)
    jax.block_until_ready(state)
    return gpu_events(lambda: jax.block_until_ready(f(graphdef, state, batch)), cats=None)


def print_gaps(gpu, host, top):
    """Where the GPU sits idle inside the step: the largest gaps between consecutive GPU events and
    the kernels around them, then the host's CUDA calls by name (a loop the host drives shows as a
    launch or a copy per iteration)."""
    gpu = sorted(gpu, key=lambda e: e["ts"])
    gaps = [(b["ts"] - (a["ts"] + a["dur"]), a["name"][:40], b["name"][:40]) for a, b in zip(gpu, gpu[1:])]
    idle = sum(g for g, _, _ in gaps if g > 0)
    print(f"  idle between GPU events: {idle:.0f} us in {sum(g > 1 for g, _, _ in gaps)} gaps over 1 us")
    by_pair = collections.defaultdict(lambda: [0.0, 0])
    for g, a, b in gaps:
        if g > 1:
            by_pair[(a, b)][0] += g
            by_pair[(a, b)][1] += 1
    for (a, b), (g, n) in sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {g:9.0f} us {n:5d}x  idle after {a} before {b}")
    calls = collections.defaultdict(lambda: [0.0, 0])
    for e in host:
        calls[e["name"]][0] += e["dur"]
        calls[e["name"]][1] += 1
    print("  host CUDA calls:")
    for name, (dur, n) in sorted(calls.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {dur:9.0f} us {n:5d}x  {name}")


GEMM_MARKS = ("nvjet", "gemm", "cutlass", "xmma", "cublas", "_nn_", "_nt_", "_tn_", "_tt_")


def kind_of(kernel):
    """Which of the step's three parts a kernel belongs to: the matrix products (cuBLAS, cuBLASLt's
    nvjet, XLA's Triton gemm fusions), our stitched kernels, or XLA's other (memory-bound) kernels."""
    if "jaxstitch" in kernel:
        return "ours"
    return "matrix products" if any(m in kernel for m in GEMM_MARKS) else "XLA other"


def roofline_bound(report, parts: dict, jit_busy_us: float, bandwidth: float) -> str:
    """What the step's GPU busy time would be if every stitched kernel moved only its must-move bytes
    at the copy bandwidth and nothing else changed: the most this partition can give, against which
    a speedup asked of the whole step (issue 4) can be read. Regions inside loop bodies run more
    than once, so with any of them stitched there is no single-call bound to give."""
    stitched = [r for r in report.regions if r.stitched]
    if any(r.where for r in stitched):
        return "  (bound not given: stitched regions inside loop bodies run once an iteration)"
    ideal = sum(r.est_bytes or 0 for r in stitched) / bandwidth * 1e6
    rest = sum(d for k, (d, _) in parts.items() if k != "ours")
    return (f"  at the roofline ({len(stitched)} stitched regions' must-move bytes at "
            f"{bandwidth / 1e9:.0f} GB/s): ours {ideal:.0f} us instead of {parts['ours'][0]:.0f}; "
            f"busy {rest + ideal:.0f} us, {jit_busy_us / (rest + ideal):.3f}x over jax.jit's busy time")


def launched_grid(r, target) -> int:
    """The grid a stitched region's kernel launches with: a cooperative one (a grid barrier, or rows
    split over blocks) only as many blocks as are resident at once, which its compiled registers
    can make fewer than the plan's (BERT's layernorm backward: 71 registers, 3 blocks of 256 an SM,
    396 for the plan's 528)."""
    if not r.registers or not (r.scheme == "global" or "split over" in (r.mapping or "")):
        return r.grid
    return target.resident_grid(r.grid, r.block, r.registers)


def ours_by_launch(events, report, bandwidth: float, target=TARGETS["h100"]) -> list[str]:
    """Our kernels' measured time against their roofline, per group of stitched regions launched
    alike (grid and block size, as CUPTI records them; a cooperative kernel's grid as launched, see
    launched_grid): which regions hold the step's distance from the roofline. Groups the plan has
    but the timeline lacks (or the reverse) show a count of 0."""
    def size(dims):
        return math.prod(int(d) for d in dims or ())
    measured = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if kind_of(e["name"]) == "ours":
            a = e.get("args", {})
            key = (size(a.get("grid")), size(a.get("block")))
            measured[key][0] += e["dur"]
            measured[key][1] += 1
    planned = collections.defaultdict(list)
    for r in report.regions:
        if r.stitched and not r.where:
            planned[(launched_grid(r, target), r.block)].append(r)
    lines = []
    for key in sorted(set(measured) | set(planned), key=lambda k: -measured[k][0]):
        rs = planned.get(key, [])
        us, n = measured[key]
        roof = sum(r.est_bytes or 0 for r in rs) / bandwidth * 1e6
        est = sum(r.est_us or 0 for r in rs)
        what = (f"{rs[0].mapping} {rs[0].rows}x{rs[0].cols} #{','.join(str(r.index) for r in rs[:3])}"
                f"{'...' if len(rs) > 3 else ''}: {' '.join(rs[0].ops[:6])}") if rs else "(not in the plan)"
        pct = f"{100 * roof / us:4.0f}%" if us else "   -"
        lines.append(f"  {us:8.0f} us {n:3d}x  roofline {roof:7.0f} us {pct}  est {est:7.0f}  "
                     f"({len(rs)} regions, grid {key[0]} x {key[1]})  {what}")
    return lines


def main():
    p = model_arguments(argparse.ArgumentParser())
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--gaps", action="store_true", help="also where the GPU idles, and the host's CUDA calls")
    p.add_argument("--tune", nargs="*", default=[], help="JAXSTITCH_TUNE specs, one jaxstitch.jit variant each")
    args = p.parse_args()
    example, init, batch = load_example(args)
    busy_of = {}
    variants = [("jax.jit", jax.jit, None), ("jaxstitch.jit", jaxstitch.jit, None)]
    variants += [(f"jaxstitch.jit {spec}", jaxstitch.jit, spec) for spec in args.tune]
    for name, jit, spec in variants:
        profile_variant(example, init, batch, name, jit, busy_of, args, spec)


def profile_variant(example, init, batch, name, jit, busy_of, args, spec=None):
    """One compiler's timeline, printed (`spec`: jaxstitch's planner overrides, JAXSTITCH_TUNE's form)."""
    graphdef, state = init()
    f = jit(example.train_step, static_argnums=(0,), donate_argnums=(1,), **({"tuning": spec} if spec else {}))
    every = profile(f, graphdef, state, batch(0))
    events = [e for e in every if e.get("cat") == "kernel"]
    busy = sum(e["dur"] for e in events)
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        key = e["name"][:70]
        by_name[key][0] += e["dur"]
        by_name[key][1] += 1
    print(f"\n{name}: span {span_us(events):.0f} us, GPU busy {busy:.0f} us, {len(events)} kernels")
    parts = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        parts[kind_of(e["name"])][0] += e["dur"]
        parts[kind_of(e["name"])][1] += 1
    print("  " + ", ".join(f"{k} {d:.0f} us in {n}" for k, (d, n) in sorted(parts.items())))
    busy_of[name] = busy
    if "ours" in parts:
        graphdef, state = init()
        report = jaxstitch.explain(example.train_step, graphdef, state, batch(0), tuning=spec)
        bandwidth = bench.measure_bandwidth(False, 10)
        print(roofline_bound(report, parts, busy_of["jax.jit"], bandwidth))
        print("  our kernels by launch shape (measured, roofline, the plan's estimate):")
        print("\n".join(ours_by_launch(events, report, bandwidth, detect() or TARGETS["h100"])))
    for key, (dur, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"  {dur:9.0f} us {n:5d}x  {key}")
    if args.gaps:
        print_gaps([e for e in every if e.get("cat") in GPU_EVENTS],
                   [e for e in every if e.get("cat") in ("cuda_runtime", "cuda_driver")], args.top)


if __name__ == "__main__":
    main()
