"""Shape families: one kernel for every size of the dimensions that vary (`jax.export` with symbolic
dimensions, inference serving).

A kernel's source does not name its row count (the launcher passes it, integration/ffi.py), so where a
region's kernel comes out the same for two different sizes of the varying dimensions, that one cubin
serves them all. Planning needs sizes: the program, traced once with its symbolic dimensions, is
evaluated at two sample sizes of them (trace.at_sizes: the same ops and values, so a region planned
at a sample is the symbolic program's region), both are planned over the same regions, and the
symbolic program stitches the regions whose kernels both plans agree on, with the row count read
off one of the region's buffers at run time. Regions whose kernel depends on the sizes (a row
length that varies, a view's offsets, few long rows split over blocks) stay with XLA, and say so.
A size the program reads as a value (a mean's 1/n) stays the op that makes it, outside the region,
which reads it at run time.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import threading
import time

import jax
import numpy as np

from ..core import ir
from ..core.config import Config
from ..core.targets import Target
from ..driver import build_times, pipeline, progress
from ..driver.program import Compiled, Program
from ..frontend import trace as trace_mod
from ..plan import KernelPlan, plan_region
from ..plan import mapping as mapping_mod
from ..plan.layout import FULL
from ..plan.mapping import busiest_sm_share, tasks_per_sm
from ..plan.planner import estimate_rows

log = logging.getLogger("jaxstitch")

# Each symbolic dimension's value in the two plans: large enough that both plan the many-rows
# mappings a serving batch gets, different enough that a size baked into a kernel shows.
SAMPLES = (64, 96)
_DIM_OPS = {"mod": operator.mod, "floordiv": operator.floordiv, "max": max, "min": min,
            "non_negative": lambda x: max(x, 0)}


def is_symbolic(args) -> bool:
    """Whether any argument's shape has a symbolic dimension (`jax.export.symbolic_shape`)."""
    return any(not isinstance(d, (int, np.integer)) for a in args for d in a.shape)


def _size(d, value: int) -> int:
    """A dimension (an int or a symbolic expression) with every symbol set to `value`."""
    if isinstance(d, (int, np.integer)):
        return int(d)
    env = {name: value for name in d.get_vars()}
    return int(eval(str(d), {"__builtins__": {}}, {**_DIM_OPS, **env}))  # e.g. "2*b + 1", "mod(s, 8)"


def sample_size(n) -> int:
    """A size (an int or a symbolic expression) at the first sample: to compare sizes under
    symbolic dimensions (which of two values is larger does not change with the sizes here)."""
    return _size(n, SAMPLES[0])


def _sample(args, value: int) -> list:
    return [jax.ShapeDtypeStruct(tuple(_size(d, value) for d in a.shape), a.dtype) for a in args]


@dataclasses.dataclass(frozen=True)
class BuildStats:
    """Programs jaxstitch built in this process and its own time on them (tracing at sample sizes,
    partitioning, planning, codegen, NVRTC): the cold cost a user pays before XLA's compile."""

    programs: int
    seconds: float


_built = {"programs": 0, "seconds": 0.0}
_built_lock = threading.Lock()


def build_stats() -> BuildStats:
    with _built_lock:
        return BuildStats(**_built)


def build_any(fun, flat_args, in_tree, target: Target, cfg: Config, static: dict | None = None) -> Program:
    """The program for these arguments: pipeline.build's for sizes, `build`'s (families) for symbolic
    dimensions (jax.export)."""
    t0 = time.perf_counter()
    with progress.building(progress.name_of(fun), cfg.progress) as building:  # (its name names dumps too)
        with build_times.measuring() as measured:
            builder = build if is_symbolic(flat_args) else pipeline.build
            program = builder(fun, flat_args, in_tree, target, cfg, static)
        program = dataclasses.replace(program, times=measured.times())
        building.done(program)
    with _built_lock:
        _built["programs"] += 1
        _built["seconds"] += time.perf_counter() - t0
    return program


def build(fun, flat_args, in_tree, target: Target, cfg: Config, static: dict | None = None) -> Program:
    """The program for symbolic `flat_args`: the symbolic trace, with the regions that form a family
    stitched and every other region left to XLA with the reason."""
    with build_times.stage("trace"):
        traced = pipeline.traced_with(fun, flat_args, in_tree, static, cfg)
        # Both samples are staged (their kernels compiling meanwhile) before either is completed. The
        # second takes the first's regions: a family's regions must be the same ops at both anyway.
        first, second = (trace_mod.at_sizes(traced, functools.partial(_size, value=s)) for s in SAMPLES)
    staged = [pipeline.stage(first, target, cfg)]
    staged.append(pipeline.stage(second, target, cfg, regions_of=staged[0].partition))
    plans = [pipeline.complete(st, target, cfg, bodies=False) for st in staged]
    symbolic = ir.values_by_id(traced.graph)
    other = {frozenset(op.index for op in c.plan.region.ops): c for c in plans[1].regions}
    regions = []
    for a in plans[0].regions:
        b = other.get(frozenset(op.index for op in a.plan.region.ops))
        member = _member(a, b, traced.graph.ops, symbolic)
        if member.stitched:
            with build_times.stage("plan"):
                variants = _few_rows_variants(a, b, target, cfg)
            # (JAXSTITCH_TUNE's min_gain_pct: the cost model's verdict overridden, the kernel kept)
            xla_below = 0 if cfg.tuning.min_gain_pct is not None else _xla_below(a, variants, target)
            member = dataclasses.replace(member, xla_below=xla_below,
                                         variants=tuple(v for v in variants if v[0] > xla_below))
        regions.append(member)
    return Program(traced, plans[0].partition, tuple(regions), target)


def _member(a: Compiled, b: Compiled | None, ops: tuple, values: dict) -> Compiled:
    """Region `a` (planned at the first sample) as a family member of the symbolic program (its
    `ops` and `values`), when `b` (the same ops at the second sample) compiled to the same kernel;
    else left to XLA."""
    if not a.stitched:
        return a
    why = _differs(a, b)
    source = None
    if why is None:
        source = _rows_source(a, b)
        if source is None:
            why = "no buffer of the region grows with its rows alone"
    if why is not None:
        return dataclasses.replace(a, cubin=None, error=f"not one kernel for every size: {why}")
    r = a.plan.region
    region = dataclasses.replace(
        r, ops=tuple(ops[op.index] for op in r.ops), inputs=tuple(values[v.id] for v in r.inputs),
        outputs=tuple(values[v.id] for v in r.outputs))
    return dataclasses.replace(a, plan=dataclasses.replace(a.plan, region=region), rows_source=source)


def _differs(a: Compiled, b: Compiled | None) -> str | None:
    if b is None or not b.stitched:
        return f"at the second sample size the region is {'planned otherwise' if b is None else 'not stitched'}"
    if not isinstance(a.plan.kernel, KernelPlan):
        return "a batch of tiles or independent chains (sized at planning)"
    if a.key != b.key:
        return f"its kernel's source changes with the sizes ({a.plan.kernel.mapping.name} vs {b.plan.kernel.mapping.name})"
    ma, mb = a.plan.kernel.mapping, b.plan.kernel.mapping
    if (ma.block, ma.smem_bytes, ma.rows_per_block, ma.splits, ma.grid_cap, a.plan.kernel.workspace_bytes) != (
            mb.block, mb.smem_bytes, mb.rows_per_block, mb.splits, mb.grid_cap, b.plan.kernel.workspace_bytes):
        return "its launch shape changes with the sizes"
    return None


# The row counts whose split counts (mapping.split_count: at most one (row, slice) task per SM, or
# two where one leaves over a fifth of the SMs idle) make a long-row family's rungs of split
# variants, close enough that each row count finds one that keeps most SMs busy: with four rungs
# (1, 8, 32, 64 rows: 64, 16, 4 and 2 slices) the rows just past a bound ran 0.74-0.94x of jax.jit
# (H100, 262144 float32: 3, 9, 16 and 34 rows), the rows filling a rung 0.99-1.85x. Rungs at 4 and
# 8 rows (33 and 16 slices) lost to the first rung's small slices (below); 17 rows ran 17.0 us on 6
# slices (0.95x), 15.6 on 7 (1.05x), 14.9 on 15 two to an SM stashed whole (1.11x, `_rung_splits`);
# 34 rows 27.6 us on 3 slices (0.97x), 26.9-27.8 on 7 two to an SM (0.98-1.01x); 67 rows 59.0 us a
# block per row, 44.9 on 3 slices two to an SM (1.73x).
LADDER_ROWS = (1, 16, 17, 20, 24, 32, 34, 44, 47, 64, 67)
# A stashed slice this small runs up to four to an SM (H100, 262144 float32: 64 slices of 16 KB at 4
# and 8 rows 9.2 and 10.9 us, jax.jit 10.3 and 12.2; 33 and 16 slices one to an SM there 9.7 and
# 12.9 us). Larger ones one or two to an SM: 33 slices of 32 KB up to four to an SM ran 9 and 16
# rows at 0.60x.
SMALL_SLICE_BYTES = 16 * 1024
SMALL_SLICES_PER_SM = 4


@dataclasses.dataclass(frozen=True)
class Rung:
    """A split variant of a long-row family: `splits` blocks a row, up to `per_sm` (row, slice)
    tasks to an SM (its stash sized for that), so it runs up to `most_rows` rows in one round."""
    splits: int
    per_sm: int
    most_rows: int
    compiled: Compiled
    whole: bool = False  # two tasks to an SM whose slices their stash holds whole



def _few_rows_variants(a: Compiled, b: Compiled, target: Target, cfg: Config) -> tuple[tuple[int, Compiled], ...]:
    """For a member whose long rows run a block each: the same region with each row split over
    several blocks, for row counts too few to give every SM a row (a served request of one short
    sequence over a vocabulary of 256k). One rung per (split count, tasks per SM) of LADDER_ROWS,
    where the cost model expects it to beat the member at the rung's rows; each row count then
    runs the rung whose busiest SM reads least (`_rows_to_rungs`). Planned at both samples (forced
    past the cost model's verdict, which priced the samples' many rows) and kept only where both
    agree, as members are."""
    m = a.plan.kernel.mapping
    if m.chunks == 1 or m.splits > 1 or not cfg.tuning.variants:
        return ()
    planned = []  # (rows, splits, tasks per SM, config): the rungs worth compiling
    for n, k in _rung_splits(m, target):
        per_sm = tasks_per_sm(n, k, target)
        if k < 2 or any((k, per_sm) == p[1:3] for p in planned):
            continue
        forced = dataclasses.replace(cfg, tuning=dataclasses.replace(
            cfg.tuning, splits=k, min_gain_pct=0, split_rows=target.sm_count * per_sm // k))
        plan = plan_region(a.plan.region, target, forced.tuning)
        if plan.kernel is None or plan.kernel.mapping.splits < 2:
            continue
        if estimate_rows(plan, n, target).us >= estimate_rows(a.plan, n, target).us:
            continue
        # every rung's NVRTC side by side (it releases the GIL); compile_region starts from these plans
        firsts = [pipeline.prefetch(c.plan.region, target, forced) for c in (a, b)]
        planned.append((n, k, per_sm, forced, firsts))
    rungs: dict[tuple[int, int], Rung] = {}
    for n, k, per_sm, forced, firsts in planned:
        with pipeline.starting_from(firsts):
            va, vb = (pipeline.compile_region(c.plan.region, target, forced) for c in (a, b))
        why = _differs(va, vb) or (None if va.plan.kernel.mapping.splits > 1 else "not split")
        if why is not None:
            log.info("region %d: no variant over %d blocks a row (%s)", a.plan.region.id, k, why)
            continue
        vm = va.plan.kernel.mapping
        runs = per_sm
        if _slice_bytes(va) <= SMALL_SLICE_BYTES:
            runs = max(per_sm, min(SMALL_SLICES_PER_SM, vm.max_grid // target.sm_count))
        # (a one-pass kernel keeps nothing for a later pass: as good as stashed whole)
        whole = per_sm == 2 and vm.chunks > 1 and (vm.stash == mapping_mod.REGISTERS or (
            vm.stash == mapping_mod.SHARED and vm.stashed_chunks == vm.chunks))
        rungs[(k, per_sm)] = Rung(vm.splits, runs, target.sm_count * runs // vm.splits, va, whole)
    return _rows_to_rungs(tuple(rungs.values()), m, target)


def _slice_bytes(v: Compiled) -> int:
    """Bytes of a split variant's slice of the row inputs (those its passes read)."""
    layout = v.plan.kernel.layout
    return v.plan.kernel.mapping.slice_cols * sum(
        x.itemsize for x in v.plan.kernel.region.inputs if layout.of(x).storage == FULL)


def _rung_splits(m: mapping_mod.Mapping, target: Target):
    """(rows, split count) of each rung to try: split_count's at LADDER_ROWS, and twice the slices
    of one task per SM where that makes the busiest SM read less (two to an SM; kept where they
    stash whole: `mapping._two_per_sm_whole`)."""
    for n in LADDER_ROWS:
        one = mapping_mod.split_count(n, m.n_cols, m.vec, target)
        yield n, one
        two = mapping_mod.two_per_sm_splits(n, m.n_cols, m.vec, target)
        if two and two != one:
            yield n, two


def _rows_to_rungs(rungs: tuple[Rung, ...], m: mapping_mod.Mapping, target: Target) -> tuple[tuple[int, Compiled], ...]:
    """(bound, variant) pairs in the launcher's order (it takes the first whose bound exceeds the
    rows): each row count up to the rungs' most goes to the rung that holds it in one round and
    whose busiest SM reads least; two tasks of large slices to an SM only where their stash holds
    them whole or where the member's mapping would split the rows so (`mapping.split_count`: one
    to an SM leaves over a fifth of them idle). Ties go to more slices (H100, 8 rows of 256k: 64
    slices four to an SM 10.9 us, 16 one to an SM 12.9), then to a stash sized for fewer tasks per
    SM (it holds more). A rung that wins two separate ranges appears twice. The ladder ends at the
    first row count no rung takes: the member runs from there on."""
    out: list[tuple[int, Compiled]] = []
    for rows in range(1, max((r.most_rows for r in rungs), default=0) + 1):
        two = rows * mapping_mod.split_count(rows, m.n_cols, m.vec, target) > target.sm_count
        fit = [r for r in rungs if rows <= r.most_rows
               and (two or r.whole or r.per_sm > 2 or tasks_per_sm(rows, r.splits, target) == 1)]
        if not fit:
            break
        best = min(fit, key=lambda r: (busiest_sm_share(rows, r.splits, target), -r.splits, r.per_sm))
        if out and out[-1][1] is best.compiled:
            out[-1] = (rows + 1, best.compiled)
        else:
            out.append((rows + 1, best.compiled))
    return tuple(out)


def _variant_us(v: Compiled, n: int, target: Target) -> float:
    return estimate_rows(v.plan, n, target, v.registers).us


def _row_counts(most: int) -> list[int]:
    """Row counts to weigh a family's kernels at: 1, 2, 3, 4, 6, 8, 12, ... up to `most`."""
    out, n = [], 1
    while n <= most:
        out += [n] if n < 2 else [n, n * 3 // 2] if n * 3 // 2 <= most else [n]
        n *= 2
    return sorted(set(out))


def _xla_below(a: Compiled, variants, target: Target) -> int:
    """The row count below which XLA's kernels are expected faster than the family's own (the cost
    model priced the samples' many rows; one long row of a 256k vocabulary takes a block 32 us where
    XLA spreads it over the GPU in 9 us, H200): 0 when ours are expected to win from one row on.
    Below it the program runs the region's jaxpr (a conditional on the row count that XLA resolves
    when it compiles the program for actual sizes)."""
    m = a.plan.kernel.mapping
    for n in _row_counts(target.sm_count * m.rows_per_block):
        est = estimate_rows(a.plan, n, target)
        ours = min([est.us] + [_variant_us(v, n, target) for below, v in variants if n < below])
        if ours < est.xla_us:
            return 0 if n == 1 else n
    return target.sm_count * m.rows_per_block + 1


def _rows_source(a: Compiled, b: Compiled) -> tuple[int, int] | None:
    """(buffer index, elements per row): a buffer (inputs, then outputs) whose size is the row count
    times the same number at both samples, to read the row count off at run time."""
    na, nb = a.plan.kernel.mapping.n_rows, b.plan.kernel.mapping.n_rows
    ra, rb = a.plan.region, b.plan.region
    for i, (va, vb) in enumerate(zip(ra.inputs + ra.outputs, rb.inputs + rb.outputs)):
        if va.size % na == 0 and vb.size % nb == 0 and va.size // na == vb.size // nb:
            if na != nb or va.size == vb.size:
                return i, va.size // na
    return None
