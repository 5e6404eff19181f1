"""Benchmark: jax.jit against jaxstitch.jit on the workloads of `jaxstitch.bench.workloads`.

    python -m jaxstitch.bench [--quick] [--only NAME ...] [--dtype float32|bfloat16|all]
                              [--json PATH] [--markdown] [--xla-triton auto|on|off]

For each workload and dtype both compiled functions run in the same process on the same inputs. A timing
is the median over `reps` repeats of (wall time of `inner` back-to-back calls ended by one
`jax.block_until_ready`) / `inner`, after warm-up calls; the two functions' repeats are interleaved.
The spread column is each function's repeats' interquartile range over their median.
Each function gets its own `inner`, so that one repeat lasts ~50 ms of its calls: a repeat's fixed
cost (the first dispatch and the final synchronization, ~0.2 ms) then adds ~1% to a call. (With
`inner` taken from jax.jit's call, 20 calls of a 88 µs stitched kernel read 99 µs, where a CUPTI
timeline of back-to-back calls showed 88.)
The roofline is measured in the same run by a copy kernel (`a * 1.0001` over a 1 GiB float32 array;
256 MiB with --quick): % of roofline = ((input + output bytes) / measured bandwidth) / measured time.
Kernel counts come from each executable's optimized HLO (`count_kernels`). On a GPU, jax.jit is
also timed with XLA's Triton fusion flags (XLA_TRITON), the strongest XLA to compare with.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import re
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from .workloads import WORKLOADS, workload_names

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# The strongest XLA there is to compare with: every fusion through its Triton emitter and its
# block-level rewriter. On 18 kernels outside the suite (H200, jax 0.11.2) they changed nothing;
# newer XLA autotunes each fusion between its native and Triton emitters, so the column stays. On a
# GPU only (`--xla-triton`); where this XLA lacks the flags, the column reads "-".
XLA_TRITON = {"xla_gpu_experimental_all_fusions_with_triton": True,
              "xla_gpu_experimental_enable_fusion_block_level_rewriter": True}
WARMUP_CALLS = 3
TARGET_REPEAT_S = 0.05  # `inner` is picked so one repeat takes about this long
MAX_INNER = 1000


# ----------------------------------------------------------------------------------------------------
# Kernel counting
# ----------------------------------------------------------------------------------------------------

# Instructions that launch nothing.
_NO_KERNEL = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "add-dependency",
    "opt-barrier", "partition-id", "replica-id", "domain",
})
# Instructions that launch nothing themselves but run the computations they name.
_CONTROL = frozenset({"call", "while", "conditional", "async-start"})
_CALLED = re.compile(
    r"\b(?:calls|to_apply|body|condition|branch_computations|true_computation|false_computation)="
    r"(\{[^}]*\}|%?[\w.\-]+)")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*)?\{\s*$")
_INSTR = re.compile(r"^\s+(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*)$")


def _opcode(rhs: str) -> str | None:
    """The opcode of an instruction's right-hand side `TYPE opcode(operands), attrs`."""
    if rhs.startswith("("):  # tuple type: skip to its balanced ')'
        depth = 0
        for i, ch in enumerate(rhs):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                break
        i += 1
    else:
        i = rhs.find(" ")
    m = re.match(r"\s*([a-z][\w\-]*)\(", rhs[i:])
    return m.group(1) if m else None


def _parse_hlo(hlo_text: str) -> tuple[dict[str, list[tuple[str, list[str]]]], str | None]:
    """{computation: [(opcode, called computations)]} and the ENTRY computation's name."""
    comps, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = comps.setdefault(m.group(2), [])
                entry = m.group(2) if m.group(1) else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if m and (op := _opcode(m.group(1))):
            called = [name.strip().lstrip("%") for group in _CALLED.findall(m.group(1))
                      for name in group.strip("{}").split(",") if name.strip()]
            current.append((op, called))
    return comps, entry


def count_kernels(hlo_text: str) -> int:
    """Kernel launches in an optimized HLO module (the text of `compiled.as_text()`).

    Walks from ENTRY: a `fusion` or `custom-call` is one launch and its body is not looked into; so is
    any other instruction outside fused bodies (reduce, copy, sort, dot, ...) except those that launch
    nothing (parameter, constant, tuple, bitcast, ...). `call` / `while` / `conditional` / `async-start`
    are not launches themselves: the computations they run are counted instead (XLA GPU wraps launch
    sequences in `command_buffer` computations called this way). `*-done` / `*-update` halves of async
    pairs are not counted again.
    """
    comps, entry = _parse_hlo(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation in HLO text")

    def count(name, stack):
        if name in stack or name not in comps:
            return 0
        total = 0
        for op, called in comps[name]:
            if op in _CONTROL:
                total += sum(count(c, stack | {name}) for c in called)
            elif op not in _NO_KERNEL and not op.endswith(("-done", "-update")):
                total += 1
        return total

    return count(entry, frozenset())


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_COLLECTIVE = re.compile(r"\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """{kind: count} of the collectives in an optimized HLO module (an async pair counts once)."""
    found = _COLLECTIVE.findall(hlo_text)
    return {k: found.count(k) for k in COLLECTIVES}


def compiled_kernels(jitted, args) -> int | None:
    """count_kernels of `jitted`'s executable for `args`, or None where it cannot be lowered."""
    try:
        return count_kernels(jitted.lower(*args).compile().as_text())
    except Exception:  # noqa: BLE001 - a wrapper without .lower(); the count is informative only
        return None


# ----------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------

def _run(f, args, calls):
    out = None
    for _ in range(calls):
        out = f(*args)
    jax.block_until_ready(out)


def _seconds_per_call(f, args, inner) -> float:
    t0 = time.perf_counter()
    _run(f, args, inner)
    return (time.perf_counter() - t0) / inner


def time_fn(f, args, reps, inner) -> float:
    """Median over `reps` of the wall time of `inner` back-to-back calls (one final block) / inner, µs."""
    return time_fns([f], args, reps, [inner])[0]


def time_fns(fs, args, reps, inners) -> list[float]:
    """`time_fn` of each of `fs` (with its own `inners[i]` calls per repeat), their repeats interleaved
    (order rotating) so drift hits all alike."""
    return [median for median, _ in timed_spread(fs, args, reps, inners)]


def timed_spread(fs, args, reps, inners) -> list[tuple[float, float]]:
    """(median µs a call, spread %) of each of `fs`, timed as `time_fns` does. The spread is the
    repeats' interquartile range over their median: robust to the odd repeat a host hiccup slows,
    and what tells a real difference of two medians from noise."""
    for f in fs:
        _run(f, args, WARMUP_CALLS)
    samples = [[] for _ in fs]
    for r in range(reps):
        for k in range(len(fs)):
            i = (r + k) % len(fs)
            samples[i].append(_seconds_per_call(fs[i], args, inners[i]))
    return [(statistics.median(s) * 1e6, spread_pct(s)) for s in samples]


def spread_pct(samples) -> float:
    """The samples' interquartile range as a percentage of their median (0 for fewer than two)."""
    if len(samples) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return 100.0 * (q3 - q1) / statistics.median(samples)


def pick_inner(f, args, target_s=TARGET_REPEAT_S, max_inner=MAX_INNER) -> int:
    """Back-to-back calls per repeat so one repeat lasts about `target_s` (launch overhead amortized);
    the call's time is read off a few back-to-back calls, not one synchronized call."""
    _run(f, args, 2)
    per_call = _seconds_per_call(f, args, 5)
    return max(1, min(max_inner, math.ceil(target_s / max(per_call, 1e-9))))


def measure_bandwidth(quick: bool, reps: int) -> float:
    """Bytes per second (read + written) of `a * 1.0001` over a 1 GiB (quick: 256 MiB) f32 array."""
    n = (256 if quick else 1024) * 2**20 // 4
    a = jnp.ones((n,), jnp.float32)
    copy = jax.jit(lambda v: v * 1.0001)
    us = time_fn(copy, (a,), reps, pick_inner(copy, (a,)))
    return 2 * a.nbytes / (us * 1e-6)


# ----------------------------------------------------------------------------------------------------
# One workload
# ----------------------------------------------------------------------------------------------------

def tree_bytes(tree) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def max_rel_err(got, want) -> float:
    """Worst over output leaves of max|got - want| / max|want|."""
    worst = 0.0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        scale = np.max(np.abs(w)) if w.size else 0.0
        diff = np.max(np.abs(g - w)) if w.size else 0.0
        worst = max(worst, float(diff / scale) if scale > 0 else float(diff))
    return worst


def stitch_jit():
    """`jaxstitch.jit` without the guard (the stitched program itself, which the benchmark measures;
    the guard would swap in jax.jit's where it is slower), or None without the package."""
    try:
        import jaxstitch
    except ImportError:
        return None
    return functools.partial(jaxstitch.jit, guard=False)


def bench_one(workload, dtype_name, quick, reps, bandwidth, stitch, tunings=(), xla_triton=False) -> dict:
    """Times jax.jit and jaxstitch.jit of one workload; returns a row of numbers. Each of `tunings`
    (JAXSTITCH_TUNE specs) adds a stitched variant timed in the same interleaved repeats, and
    `xla_triton` jax.jit compiled with XLA_TRITON."""
    args = workload.make_inputs(jax.random.key(0), DTYPES[dtype_name], quick)
    xla_f, stitch_f = jax.jit(workload.fn), stitch(workload.fn)
    want = jax.block_until_ready(xla_f(*args))
    got = jax.block_until_ready(stitch_f(*args))
    variants = []
    for spec in tunings:
        f = stitch(workload.fn, tuning=spec)
        variant_err = max_rel_err(jax.block_until_ready(f(*args)), want)
        variants.append((spec, f, variant_err))
    triton_f = _xla_triton(workload.fn, args) if xla_triton else None
    moved = tree_bytes(args) + tree_bytes(want)
    fns = [xla_f, stitch_f] + [f for _, f, _ in variants] + ([triton_f] if triton_f else [])
    inner = [pick_inner(f, args) for f in fns]
    (xla_us, xla_spread), (stitch_us, stitch_spread), *rest = timed_spread(fns, args, reps, inner)
    rest = [us for us, _ in rest]
    variant_us, triton_us = rest[:len(variants)], (rest[-1] if triton_f else None)
    ideal_us = moved / bandwidth * 1e6
    return {
        "variants": [{"tune": spec, "stitch_us": us, "max_rel_err": err, "kernels": compiled_kernels(f, args)}
                     for (spec, f, err), us in zip(variants, variant_us)],
        "workload": workload.name, "dtype": dtype_name,
        "shape": list(workload.shape(quick)), "bytes": moved, "inner": inner, "reps": reps,
        "jit_us": xla_us, "stitch_us": stitch_us, "speedup": xla_us / stitch_us, "jit_triton_us": triton_us,
        "jit_spread_pct": xla_spread, "stitch_spread_pct": stitch_spread,
        "roofline_stitch": ideal_us / stitch_us, "roofline_jit": ideal_us / xla_us,
        "kernels_jit": compiled_kernels(xla_f, args), "kernels_stitch": compiled_kernels(stitch_f, args),
        "max_rel_err": max_rel_err(got, want),
    }


def _xla_triton(fn, args):
    """jax.jit of `fn` under XLA_TRITON, compiled and run once; None where this XLA refuses them."""
    f = jax.jit(fn, compiler_options=XLA_TRITON)
    try:
        jax.block_until_ready(f(*args))
    except Exception as e:  # noqa: BLE001 - (an XLA without the flags: the column reads "-")
        print(f"  (jax.jit with XLA's Triton flags: {type(e).__name__}: {str(e).splitlines()[0][:160]})")
        return None
    return f


# ----------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------

COLUMNS = ("workload", "dtype", "jax.jit µs", "jaxstitch µs", "speedup", "spread % (jit/stitch)",
           "jax.jit+Triton µs", "% roofline (stitch)", "% roofline (jit)", "kernels (jit→stitch)", "max rel err")


def _cells(row) -> list[str]:
    kern = lambda k: "?" if k is None else str(k)  # noqa: E731
    triton = row.get("jit_triton_us")
    spread = (f"{row['jit_spread_pct']:.1f}/{row['stitch_spread_pct']:.1f}"
              if "jit_spread_pct" in row else "-")  # (rows from before the column: "-")
    return [row["workload"], row["dtype"], f"{row['jit_us']:.1f}", f"{row['stitch_us']:.1f}",
            f"{row['speedup']:.2f}x", spread, "-" if triton is None else f"{triton:.1f}",
            f"{100 * row['roofline_stitch']:.0f}%", f"{100 * row['roofline_jit']:.0f}%",
            f"{kern(row['kernels_jit'])}→{kern(row['kernels_stitch'])}", f"{row['max_rel_err']:.1e}"]


def _error_cells(row) -> list[str]:
    return [row["workload"], row["dtype"], "ERROR: " + row["error"].splitlines()[0][:200]]


def header_line(meta) -> str:
    return (f"device: {meta['device']} | date: {meta['date']} | measured bandwidth: "
            f"{meta['bandwidth_gbs']:.0f} GB/s | jax {meta['jax_version']}"
            + (" | quick sizes" if meta["quick"] else ""))


def format_table(rows, meta) -> str:
    """Aligned plain-text table under the header line; a failed case is one unaligned ERROR line."""
    ok = [list(COLUMNS)] + [_cells(r) for r in rows if "error" not in r]
    widths = [max(len(c[i]) for c in ok) for i in range(len(COLUMNS))]

    def line(c):
        return "  ".join(x.ljust(w) if j < 2 else x.rjust(w) for j, (x, w) in enumerate(zip(c, widths)))

    lines = [header_line(meta), line(ok[0]), "  ".join("-" * w for w in widths)]
    lines += [line(c) for c in ok[1:]]
    lines += ["  ".join(_error_cells(r)) for r in rows if "error" in r]
    return "\n".join(lines + [summary_line(rows)])


def summary_line(rows) -> str:
    """The geometric mean of the speedups over every case that ran, and the slowest case."""
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return "no case ran"
    geo = math.exp(sum(math.log(r["speedup"]) for r in ok) / len(ok))
    low = min(ok, key=lambda r: r["speedup"])
    return (f"geomean speedup over {len(ok)} cases: {geo:.2f}x; slowest: {low['workload']} {low['dtype']} "
            f"{low['speedup']:.2f}x")


def format_variants(rows) -> str:
    """Per workload: the default plan's time and each tuning variant's, as a speedup over the default."""
    lines = ["tuning variants (µs; x = default / variant, >1 means the variant is faster)"]
    for r in rows:
        if "error" in r:
            continue
        cells = [f"{v['tune']}: {v['stitch_us']:.1f} ({r['stitch_us'] / v['stitch_us']:.2f}x, "
                 f"{v.get('kernels', '?')} kernels"
                 + (", ERR %.1e" % v["max_rel_err"] if v["max_rel_err"] > 1e-2 else "") + ")"
                 for v in r["variants"]]
        lines.append(f"  {r['workload']} {r['dtype']}: default {r['stitch_us']:.1f} | " + " | ".join(cells))
    return "\n".join(lines)


def format_markdown(rows, meta) -> str:
    def line(c):
        return "| " + " | ".join(c + [""] * (len(COLUMNS) - len(c))) + " |"

    lines = [header_line(meta), "", line(list(COLUMNS)),
             "|" + "|".join("---" if i < 2 else "---:" for i in range(len(COLUMNS))) + "|"]
    lines += [line(_error_cells(r) if "error" in r else _cells(r)) for r in rows]
    return "\n".join(lines + ["", summary_line(rows)])


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m jaxstitch.bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes (a few MB; CPU-friendly)")
    p.add_argument("--only", nargs="+", metavar="NAME", choices=workload_names(),
                   help="workloads to run (default: all): " + ", ".join(workload_names()))
    p.add_argument("--dtype", choices=[*DTYPES, "all"], default="all")
    p.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    p.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    p.add_argument("--reps", type=int, help="timed repeats per function (default 20; quick 5)")
    p.add_argument("--tune", nargs="+", metavar="SPEC", default=[],
                   help='also time stitched variants planned with JAXSTITCH_TUNE=SPEC, e.g. "elems=16,max_tpr=64"')
    p.add_argument("--xla-triton", choices=["auto", "on", "off"], default="auto",
                   help="also time jax.jit with XLA's Triton fusion flags (auto: on a GPU)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    stitch = stitch_jit()
    if stitch is None:
        print("error: jaxstitch.jit is not available (import jaxstitch has no `jit`); "
              "nothing to compare against jax.jit", file=sys.stderr)
        return 2
    reps = args.reps or (5 if args.quick else 20)
    dtypes = list(DTYPES) if args.dtype == "all" else [args.dtype]
    names = args.only or workload_names()

    xla_triton = args.xla_triton == "on" or (args.xla_triton == "auto" and jax.default_backend() == "gpu")
    bandwidth = measure_bandwidth(args.quick, reps)
    meta = {"device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "jax_version": jax.__version__, "bandwidth_gbs": bandwidth / 1e9, "quick": args.quick}
    print(header_line(meta), flush=True)

    rows = []
    for name in names:
        for dtype_name in dtypes:
            try:
                row = bench_one(WORKLOADS[name], dtype_name, args.quick, reps, bandwidth, stitch, args.tune,
                                xla_triton)
            except Exception as e:  # noqa: BLE001 - one failing case must not hide the others
                traceback.print_exc()
                row = {"workload": name, "dtype": dtype_name, "error": f"{type(e).__name__}: {e}"}
            rows.append(row)
            print("  " + " ".join((_error_cells if "error" in row else _cells)(row)[:5]), flush=True)

    print()
    print(format_table(rows, meta))
    if args.tune:
        print()
        print(format_variants(rows))
    if args.markdown:
        print()
        print(format_markdown(rows, meta))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return 1 if any("error" in r for r in rows) else 0

