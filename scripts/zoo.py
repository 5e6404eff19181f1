"""The model zoo (examples/zoo) under jax.jit and jaxstitch.jit: step time, GPU time and its split,
the memory-bound kernels against their roofline, loss agreement and compile time, model by model.

    python3 scripts/zoo.py [--only NAME ...] [--dtype float32 bfloat16] [--steps 100] [--repeats 3]
                           [--rounds 5] [--round-steps 10] [--quick] [--json PATH]
    python3 scripts/zoo.py --target h100 --quick --only dlrm --steps 4   # CPU dry run
    python3 scripts/zoo.py --table run1/zoo.json run2/zoo.json           # one table from several runs

For each model and dtype, in one process:
  * both compilers' first call (tracing, jaxstitch's planning and NVRTC with an empty kernel cache,
    XLA's compile, one step): the compile time; jaxstitch's NVRTC share of it, and the plan's time
    again with the cubins in memory (`jaxstitch.explain`'s seconds: the warm-cache planning);
  * `--steps` steps of each from the same init on the same batches: the loss curves' largest relative
    difference and the final losses (train steps donate their state, as in training; inference steps
    only read it);
  * step time by the wall clock: `--repeats` repeats of `--rounds` rounds of `--round-steps` steps
    on one batch, the two compilers in turns, the garbage collector off (as in scripts/step_ab.py); a
    round's time is its steps dispatched back to back and waited for, over their number. Reported: the
    median of the repeats' medians, the rounds' min-max, and the repeats' spread (the largest
    distance of a repeat's median from their median; the zoo asks for +-5%);
  * GPU time a step from CUPTI (torch's profiler, scripts/device_time.py) over a round: the span and
    the busy time split into matrix products (cuBLAS / cuDNN / CUTLASS / nvjet kernels), our stitched
    kernels (`jaxstitch_kernel`) and XLA's other kernels (its memory-bound fusions, copies, reductions);
  * the memory-bound kernels against the roofline at the target's bandwidth (jaxstitch/core/targets.py):
    ours against the must-move bytes the plan estimates for its stitched regions (`explain`'s
    est_bytes; regions inside loop bodies, which run once an iteration, are left out and counted);
    XLA's other kernels against the bytes their operands and results name in the optimized HLO (a
    kernel reading a slice of an operand counts all of it; loop bodies once): an approximate roofline.
    Also the memory-bound time of jax.jit over that of jaxstitch (ours plus XLA's other kernels).

Without a GPU, `--target` plans for that GPU and runs the stitched regions through XLA: wall times,
losses and compile times only (no CUPTI). Results go to `--json` (default $OUT/zoo.json, else
/tmp/zoo.json), rewritten after each model so a run cut short keeps what it finished.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time
import traceback

os.environ.setdefault("JAXSTITCH_GUARD", "0")  # (the stitched program itself, not the guard's choice)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "examples"), HERE]  # (examples/ first: its zoo package, not this file)
sys.path.append(os.path.join(HERE, ".."))  # (jaxstitch from this checkout where it is not installed)
device_time = None
if __name__ == "__main__" and not {"--target", "--table"} & set(sys.argv):
    try:  # torch's CUPTI profiler, imported before jax (their CUDA context is shared)
        import device_time
    except Exception as e:  # (no torch, or no GPU: wall times only)
        print(f"(no CUPTI timeline: {type(e).__name__}: {e})", file=sys.stderr)

import jax  # noqa: E402

import jaxstitch  # noqa: E402
from jaxstitch.integration.devices import detect
from jaxstitch.targets import get_target  # noqa: E402
import zoo  # noqa: E402
from zoo import common  # noqa: E402
import train_harness  # noqa: E402

RTOL = {"float32": 2e-3, "bfloat16": 2e-2}  # loss curves "match" within these (examples/train_harness.py)
STABLE = 0.05  # each repeat's median within +-5% of their median: what the zoo asks for
# Matrix-product kernels by name: cuBLAS(Lt) (gemm, nvjet, cutlass, xmma, *_nn_/_nt_ tiles, split-K
# reductions), XLA's Triton gemm fusions (gemm_fusion, triton_gemm), cuDNN
# convolutions (implicit gemm, fprop/dgrad/wgrad, winograd, direct grouped kernels, its layout
# transposes). XLA's own kernels are named after their fusions (loop_convert_fusion: not "conv").
MATRIX = re.compile(r"gemm|cutlass|cublas|cudnn|nvjet|xmma|fprop|dgrad|wgrad|winograd|convolve|conv2d|"
                    r"conv1d|convolution|_conv_|grouped_direct|implicit|nchwToNhwc|nhwcToNchw|splitKreduce|"
                    r"_nn_|_nt_|_tn_|_tt_", re.IGNORECASE)


def kernel_kind(name: str) -> str:
    """'ours', 'matrix' or 'xla' (everything else XLA launches: memory-bound fusions, copies)."""
    if "jaxstitch" in name:
        return "ours"
    return "matrix" if MATRIX.search(name) else "xla"


# ----------------------------------------------------------------------------------------------------
# Bytes XLA's kernels name in the optimized HLO
# ----------------------------------------------------------------------------------------------------

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*)?\{\s*$")
_INSTR = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_SHAPE = re.compile(r"\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8\w*|bf16|f16|f32|f64|c64|c128)\[([\d,]*)\]")
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "bf16": 16, "f16": 16,
         "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128}
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations|true_computation|false_computation)="
                    r"(\{[^}]*\}|%?[\w.\-]+)")
_NO_KERNEL = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "add-dependency",
              "opt-barrier", "partition-id", "replica-id", "domain"}
_CONTROL = {"call", "while", "conditional", "async-start"}
OURS_TARGETS = ("jaxstitch_launch", "__gpu$xla.gpu.ptx")


def shape_bytes(text: str) -> int:
    """Bytes of every array shape written in `text` (a type, or a tuple of them)."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BITS.get(dtype, 8 if dtype.startswith("f8") else 32) // 8
    return total


def _instructions(hlo: str) -> dict[str, list[tuple[str, str, str]]]:
    """{computation: [(name, result type, the rest: opcode, operands, attributes)]}."""
    comps, current = {}, None
    for line in hlo.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = comps.setdefault(m.group(1), [])
                if line.startswith("ENTRY"):
                    comps["__entry__"] = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            rhs = m.group(2)
            cut = _type_end(rhs)
            current.append((m.group(1), rhs[:cut], rhs[cut:]))
    return comps


def _type_end(rhs: str) -> int:
    """Where an instruction's result type ends: after its balanced tuple parentheses, or the first space."""
    if not rhs.startswith("("):
        return max(rhs.find(" "), 0)
    depth = 0
    for i, ch in enumerate(rhs):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return i + 1
    return len(rhs)


def _operands(rest: str) -> str:
    """The operand list of an instruction's `opcode(operands), attributes`."""
    start = rest.index("(")
    depth = 0
    for i in range(start, len(rest)):
        depth += (rest[i] == "(") - (rest[i] == ")")
        if depth == 0:
            return rest[start + 1:i]
    return rest[start + 1:]


def hlo_kernel_bytes(hlo: str) -> dict[str, list[int]]:
    """{'matrix' | 'ours' | 'xla': [kernels, bytes of their operands and results]} over the kernels
    an optimized HLO module launches (as jaxstitch.bench.runner.count_kernels walks it: fusions and
    custom calls from ENTRY, through calls, command buffers and loop bodies, each body once)."""
    comps = _instructions(hlo)
    out = {"matrix": [0, 0], "ours": [0, 0], "xla": [0, 0]}

    def walk(name, seen):
        if name in seen or name not in comps:
            return
        sizes = {n: shape_bytes(t) for n, t, _ in comps[name]}
        for n, rtype, rest in comps[name]:
            op = re.match(r"\s*([a-z][\w\-]*)\(", rest)
            op = op.group(1) if op else ""
            if op in _CONTROL:
                for group in _CALLS.findall(rest):
                    for called in group.strip("{}").split(","):
                        walk(called.strip().lstrip("%"), seen | {name})
                continue
            if not op or op in _NO_KERNEL or op.endswith(("-done", "-update")):
                continue
            moved = sizes[n] + sum(sizes.get(a, 0) for a in re.findall(r"%([\w.\-]+)", _operands(rest)))
            kind = ("ours" if any(t in rest for t in OURS_TARGETS) else
                    "matrix" if op in ("dot", "convolution") or re.search(
                        r"__cublas|__cudnn|cublas|gemm|\"kind\":\"__cudnn", rest) else "xla")
            out[kind][0] += 1
            out[kind][1] += moved
    walk("__entry__", frozenset())
    return out


# ----------------------------------------------------------------------------------------------------
# One compiler's run
# ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Variant:
    """A compiler's jitted step, its state, and what was measured of it."""

    name: str
    jit: object
    f: object = None
    graphdef: object = None
    state: object = None      # (a training step's: the state's leaves)
    treedef: object = None
    compile_s: float = 0.0
    nvrtc: dict | None = None
    losses: list = dataclasses.field(default_factory=list)
    rounds: list = dataclasses.field(default_factory=list)   # per repeat: ms a step, a round each
    gpu: list = dataclasses.field(default_factory=list)      # per profiled round: dict of ms a step
    hlo: dict | None = None

    def nnx_state(self):
        """The state as the model's step takes it (an nnx.State)."""
        return jax.tree.unflatten(self.treedef, jax.tree.leaves(self.state))

    def step(self, batch, donate: bool):
        loss, out = self.f(self.state, batch)
        if donate:
            self.state = out
        return loss


def first_call(v: Variant, model, init, batch) -> None:
    """The variant's first step from `init()`: tracing, planning, compiling and running, timed."""
    v.graphdef, state = jax.block_until_ready(init())
    if model.inference:
        v.f, v.state = v.jit(functools.partial(model.step, v.graphdef)), state
    else:  # (over the state's leaves, as the train examples: train_harness.over_leaves)
        flat, v.state = train_harness.over_leaves(model.step, v.graphdef, state)
        v.f = v.jit(flat, donate_argnums=(0,))
    v.treedef = jax.tree.structure(state)
    before, t0 = jaxstitch.cache_stats(), time.perf_counter()
    loss = v.step(batch, not model.inference)
    jax.block_until_ready((loss, v.state))
    v.compile_s = time.perf_counter() - t0
    after = jaxstitch.cache_stats()
    if v.name != "jax.jit":
        v.nvrtc = {"compiles": after.nvrtc_compiles - before.nvrtc_compiles,
                   "seconds": after.nvrtc_seconds - before.nvrtc_seconds,
                   "busy_seconds": after.nvrtc_busy_seconds - before.nvrtc_busy_seconds}
    v.losses = [float(loss)]


def loss_curve(v: Variant, model, batch, steps: int) -> None:
    """Steps 1..steps-1 after the first call, on batch(i): the rest of the loss curve."""
    losses = [v.step(batch(i), not model.inference) for i in range(1, steps)]
    v.losses += [float(x) for x in jax.device_get(losses)]


def timed_round(v: Variant, batch, steps: int, donate: bool) -> float:
    """ms a step of `steps` steps dispatched back to back, then waited for."""
    t0 = time.perf_counter()
    losses = [v.step(batch, donate) for _ in range(steps)]
    jax.block_until_ready((losses, v.state))
    return (time.perf_counter() - t0) * 1e3 / steps


def time_in_turns(variants, batch, args, donate: bool) -> None:
    """`repeats` x `rounds` rounds, the variants in turns, the garbage collector off."""
    for v in variants:
        timed_round(v, batch, args.round_steps, donate)  # (warm: a round after the loss curve's batches)
    gc.collect()
    gc.disable()
    try:
        for _ in range(args.repeats):
            for v in variants:
                v.rounds.append([])
            for _ in range(args.rounds):
                for v in variants:
                    v.rounds[-1].append(timed_round(v, batch, args.round_steps, donate))
    finally:
        gc.enable()


def gpu_profile(v: Variant, batch, steps: int, donate: bool, rounds: int) -> None:
    """CUPTI events of `rounds` rounds of `steps` steps: span, busy and its split, ms a step."""
    for _ in range(rounds):
        events = device_time.gpu_events(lambda: timed_round(v, batch, steps, donate))
        kernels = [e for e in events if e.get("cat") == "kernel"]
        split = {"matrix": 0.0, "ours": 0.0, "xla": 0.0}
        for e in kernels:
            split[kernel_kind(e["name"])] += e["dur"] / 1e3 / steps
        v.gpu.append({"span_ms": device_time.span_us(events) / 1e3 / steps,
                      "busy_ms": sum(e["dur"] for e in kernels) / 1e3 / steps,
                      "kernels": len(kernels) / steps, **split})


# ----------------------------------------------------------------------------------------------------
# A model and dtype
# ----------------------------------------------------------------------------------------------------

def measure(model, c, args, target) -> dict:
    """Everything the zoo reports of one model at one config, as a JSON-ready record."""
    init, batch = model.make_init(c, args.seed), jax.jit(model.make_batches(c, args.seed))
    donate = not model.inference
    options = {"compiler_options": args.compiler_options} if args.compiler_options else {}
    variants = [Variant("jax.jit", functools.partial(jax.jit, **options)),
                Variant("jaxstitch.jit", functools.partial(jaxstitch.jit, target=args.target, **options))]
    b0 = batch(0)
    for v in variants:
        first_call(v, model, init, b0)
        print(f"  ({v.name}: first call {v.compile_s:.1f} s)", flush=True)
    for v in variants:
        loss_curve(v, model, batch, args.steps)
    time_in_turns(variants, b0, args, donate)
    if device_time is not None:
        for v in variants:
            gpu_profile(v, b0, args.round_steps, donate, args.gpu_rounds)
    for v in variants:
        try:
            v.hlo = hlo_kernel_bytes(v.f.lower(v.state, b0).compile().as_text())
        except Exception as e:  # (an approximate roofline only: never worth the run)
            print(f"  ({v.name}: no HLO bytes: {type(e).__name__}: {e})")
    t0 = time.perf_counter()
    report = jaxstitch.explain(model.step, variants[1].graphdef, variants[1].nnx_state(), b0, target=target)
    plan_s = time.perf_counter() - t0
    return record(model, c, variants, report, plan_s, target, args)


def record(model, c, variants, report, plan_s, target, args) -> dict:
    """The JSON record of one measured model."""
    ref, ours = variants
    diff = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(ours.losses, ref.losses))
    stitched = [r for r in report.regions if r.stitched]
    top = [r for r in stitched if not r.where]
    runs = {}
    for v in variants:
        medians = [statistics.median(r) for r in v.rounds]
        every = [t for r in v.rounds for t in r]
        runs[v.name] = {"compile_s": v.compile_s, "nvrtc": v.nvrtc, "step_ms": statistics.median(medians),
                        "repeat_ms": medians, "round_min_ms": min(every), "round_max_ms": max(every),
                        "repeat_spread": max(abs(m / statistics.median(medians) - 1) for m in medians),
                        "losses": v.losses, "hlo": v.hlo,
                        "gpu": {k: statistics.median(g[k] for g in v.gpu) for k in v.gpu[0]} if v.gpu else None}
    runs["jaxstitch.jit"]["plan_warm_s"] = plan_s
    return {"model": model.name, "family": model.family, "inference": model.inference, "dtype": c.dtype,
            "config": dataclasses.asdict(c), "params": common.count_params(ref.nnx_state()),
            "device": jax.devices()[0].device_kind, "jax": jax.__version__, "target": target.name,
            "bandwidth_gbs": target.bandwidth_gbs, "date": datetime.datetime.now().isoformat(timespec="minutes"),
            "steps": args.steps, "rounds": args.rounds, "round_steps": args.round_steps, "repeats": args.repeats,
            "max_loss_rel_diff": diff, "loss_match": bool(diff <= RTOL[c.dtype]),
            "final_losses": [ref.losses[-1], ours.losses[-1]], "runs": runs,
            "plan": {"regions": len(report.regions), "stitched": len(stitched), "kernels": report.stitched_kernels,
                     "loop_body_stitched": len(stitched) - len(top),
                     "est_bytes": sum(r.est_bytes or 0 for r in top),
                     "est_us": sum(r.est_us or 0 for r in top)}}


# ----------------------------------------------------------------------------------------------------
# Printing
# ----------------------------------------------------------------------------------------------------

def memory_bound(rec: dict) -> dict | None:
    """The memory-bound kernels' GPU ms a step against their roofline ms (None without CUPTI)."""
    jit, st = rec["runs"]["jax.jit"], rec["runs"]["jaxstitch.jit"]
    if not jit["gpu"] or not st["gpu"]:
        return None
    bw = rec["bandwidth_gbs"] * 1e9 / 1e3  # bytes a ms
    hlo = lambda run: (run["hlo"] or {}).get("xla", [0, 0])[1]  # noqa: E731
    ours_ms, st_xla, jit_xla = st["gpu"]["ours"], st["gpu"]["xla"], jit["gpu"]["xla"]
    return {"ours_ms": ours_ms, "ours_roof_ms": rec["plan"]["est_bytes"] / bw,
            "jit_xla_ms": jit_xla, "jit_xla_roof_ms": hlo(jit) / bw,
            "stitch_xla_ms": st_xla, "stitch_xla_roof_ms": hlo(st) / bw,
            "jit_over_stitch": jit_xla / max(ours_ms + st_xla, 1e-9)}


def pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "-"


def run_lines(name: str, r: dict) -> list[str]:
    """One compiler's lines: step time and its spread, compile time, HLO kernels, GPU time."""
    spread = f"within +-{100 * r['repeat_spread']:.1f}%{'' if r['repeat_spread'] <= STABLE else ' UNSTABLE'}"
    line = (f"  {name:14s} step {r['step_ms']:8.2f} ms (rounds {r['round_min_ms']:.2f}-{r['round_max_ms']:.2f}, "
            f"repeats {' '.join(f'{m:.2f}' for m in r['repeat_ms'])}: {spread}); first call {r['compile_s']:.1f} s")
    if r.get("nvrtc"):
        line += (f"; NVRTC {r['nvrtc']['compiles']} kernels, {r['nvrtc']['busy_seconds']:.1f} s wall of it; "
                 f"planning again with the cubins in memory {r['plan_warm_s']:.1f} s")
    lines, pad = [line], " " * 16
    if r["hlo"]:
        h = r["hlo"]
        lines.append(f"{pad} HLO kernels: {h['matrix'][0]} matrix products, {h['ours'][0]} ours, {h['xla'][0]} XLA "
                     f"other ({h['xla'][1] / 1e6:.1f} MB named by their operands and results)")
    if r["gpu"]:
        g = r["gpu"]
        lines.append(f"{pad} GPU span {g['span_ms']:.2f} ms, busy {g['busy_ms']:.2f} ms in {g['kernels']:.0f} "
                     f"kernels: matrix products {g['matrix']:.2f}, ours {g['ours']:.2f}, XLA other {g['xla']:.2f}")
    return lines


def print_record(rec: dict) -> None:
    """One model's details."""
    print(f"\n{rec['model']} {rec['dtype']} ({rec['family']}; {rec['params']:,} parameters) on "
          f"{rec['device']}, planned for {rec['target']}")
    for name, r in rec["runs"].items():
        print("\n".join(run_lines(name, r)))
    mb = memory_bound(rec)
    if mb:
        loops = rec["plan"]["loop_body_stitched"]
        print(f"  memory-bound, GPU ms a step against the roofline at {rec['bandwidth_gbs']:.0f} GB/s: ours "
              f"{mb['ours_ms']:.2f} vs {mb['ours_roof_ms']:.2f} ({pct(mb['ours_roof_ms'], mb['ours_ms'])}"
              f"{f', {loops} loop-body regions left out' if loops else ''}); XLA's other kernels under jax.jit "
              f"{mb['jit_xla_ms']:.2f} vs {mb['jit_xla_roof_ms']:.2f} by their HLO bytes "
              f"({pct(mb['jit_xla_roof_ms'], mb['jit_xla_ms'])}), under jaxstitch {mb['stitch_xla_ms']:.2f} vs "
              f"{mb['stitch_xla_roof_ms']:.2f}; all memory-bound kernels, jax.jit over jaxstitch: "
              f"{mb['jit_over_stitch']:.2f}x")
    p = rec["plan"]
    print(f"  plan: {p['stitched']} of {p['regions']} regions stitched into {p['kernels']} kernels, "
          f"{p['est_bytes'] / 1e6:.1f} MB estimated to move, {p['est_us']:.0f} us estimated")
    print(f"  losses over {rec['steps']} steps: max relative difference {rec['max_loss_rel_diff']:.2e} "
          f"({'match' if rec['loss_match'] else 'DIFFER'}), final {rec['final_losses'][0]:.4f} (jax.jit) "
          f"{rec['final_losses'][1]:.4f} (jaxstitch)", flush=True)


def print_table(records: list[dict]) -> None:
    """The zoo's summary, a row per model and dtype (markdown)."""
    print("\n| model | dtype | jax.jit ms | jaxstitch ms | speedup | +-% repeats jit/stitch | GPU ms jit "
          "| GPU ms stitch | GPU speedup | split jit (mm/xla) | split stitch (mm/ours/xla) | ours % roofline "
          "| XLA % roofline (jit) | mem-bound jit/stitch | loss diff | compile s jit/stitch |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|")
    for rec in records:
        if "error" in rec:
            print(f"| {rec['model']} | {rec['dtype']} | error: {rec['error'][:80]} |")
            continue
        jit, st = rec["runs"]["jax.jit"], rec["runs"]["jaxstitch.jit"]
        row = [rec["model"], rec["dtype"], f"{jit['step_ms']:.2f}", f"{st['step_ms']:.2f}",
               f"{jit['step_ms'] / st['step_ms']:.2f}x",
               f"{100 * jit['repeat_spread']:.1f}/{100 * st['repeat_spread']:.1f}%"]
        mb = memory_bound(rec)
        if mb:
            gj, gs = jit["gpu"], st["gpu"]
            row += [f"{gj['span_ms']:.2f}", f"{gs['span_ms']:.2f}", f"{gj['span_ms'] / gs['span_ms']:.2f}x",
                    f"{gj['matrix']:.2f}/{gj['xla']:.2f}", f"{gs['matrix']:.2f}/{gs['ours']:.2f}/{gs['xla']:.2f}",
                    pct(mb["ours_roof_ms"], mb["ours_ms"]), pct(mb["jit_xla_roof_ms"], mb["jit_xla_ms"]),
                    f"{mb['jit_over_stitch']:.2f}x"]
        else:
            row += ["-"] * 8
        row += [f"{rec['max_loss_rel_diff']:.1e}{'' if rec['loss_match'] else ' DIFFER'}",
                f"{jit['compile_s']:.1f}/{st['compile_s']:.1f}"]
        print("| " + " | ".join(row) + " |")


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------

def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", default=list(zoo.MODELS), choices=list(zoo.MODELS), metavar="NAME",
                   help=f"models (default all: {' '.join(zoo.MODELS)})")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=100, help="steps of the loss curves")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds a repeat")
    p.add_argument("--round-steps", type=int, default=10, help="steps a timed round")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gpu-rounds", type=int, default=2, help="rounds profiled by CUPTI (median)")
    p.add_argument("--quick", action="store_true", help="the tiny QUICK configs")
    p.add_argument("--target", default=None,
                   help="plan for this GPU (h100, h200, a100): a dry run on a machine without one")
    p.add_argument("--compiler-options", type=json.loads, default=None, metavar="JSON",
                   help='XLA options for both compilers, e.g. \'{"xla_gpu_enable_command_buffer": ""}\'')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT") or "/tmp", "zoo.json"))
    p.add_argument("--keep-cache", action="store_true", help="use the kernel cache as it is (default: an empty one)")
    p.add_argument("--table", nargs="+", metavar="JSON", help="print the table of earlier runs' JSON files and stop")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    """The command line; returns the records (a test calls this with --target on a CPU)."""
    args = arguments(argv)
    if args.table:  # (compiles nothing: the cache is left as it is)
        records = [rec for path in args.table for rec in json.load(open(path))]
        for rec in records:
            if "error" not in rec:
                print_record(rec)
        print_table(records)
        return records
    if not args.keep_cache:  # jaxstitch's first build compiles every kernel: a cold cache
        os.environ["JAXSTITCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="zoo_cubins_")
    target = get_target(args.target) if args.target else detect()
    if target is None:
        sys.exit("no CUDA GPU here: pass --target (e.g. --target h100) for a dry run")
    print(f"model zoo on {jax.devices()[0].device_kind}, planned for {target.name} ({target.bandwidth_gbs:.0f} GB/s); "
          f"CUPTI {'on' if device_time else 'off'}; results in {args.json}", flush=True)
    records = []
    for name in args.only:
        model = zoo.MODELS[name]
        for dtype in args.dtype:
            c = (model.quick if args.quick else model.config)(dtype=dtype)
            print(f"\n{name} {dtype}: {c}", flush=True)
            t0 = time.perf_counter()
            try:
                rec = measure(model, c, args, target)
                rec["wall_s"] = time.perf_counter() - t0
                print_record(rec)
            except Exception as e:  # (one model's failure is reported; the others still run)
                traceback.print_exc()
                rec = {"model": name, "dtype": dtype, "error": f"{type(e).__name__}: {e}"}
            records.append(rec)
            print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
            with open(args.json, "w") as fh:
                json.dump(records, fh, indent=1)
            jax.clear_caches()
            gc.collect()
    print_table(records)
    return records


if __name__ == "__main__":
    main()
