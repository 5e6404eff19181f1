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
from ..plan import KernelPlan, ladder

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


def _few_rows_variants(a: Compiled, b: Compiled, target: Target, cfg: Config) -> tuple[tuple[int, Compiled], ...]:
    """For a member whose long rows run a block each: the planner's rungs of split variants
    (plan/ladder.py), each compiled at both samples (their NVRTC side by side) and kept only where
    both agree, as members are; then each row count's rung, as (bound, variant) pairs."""
    planned = []
    for rp in ladder.rung_plans(a.plan, target, cfg.tuning):
        forced = dataclasses.replace(cfg, tuning=rp.tuning)
        # (every rung's NVRTC side by side: it releases the GIL; compile_region starts from these plans)
        planned.append((rp, forced, [pipeline.prefetch(c.plan.region, target, forced) for c in (a, b)]))
    rungs: dict[tuple[int, int], ladder.Rung] = {}
    for rp, forced, firsts in planned:
        with pipeline.starting_from(firsts):
            va, vb = (pipeline.compile_region(c.plan.region, target, forced) for c in (a, b))
        why = _differs(va, vb) or (None if va.plan.kernel.mapping.splits > 1 else "not split")
        if why is not None:
            log.info("region %d: no variant over %d blocks a row (%s)", a.plan.region.id, rp.splits, why)
            continue
        rungs[(rp.splits, rp.per_sm)] = ladder.rung(va.plan, rp.per_sm, target, va)
    return ladder.rows_to_rungs(tuple(rungs.values()), a.plan.kernel.mapping, target)


def _xla_below(a: Compiled, variants, target: Target) -> int:
    """ladder.xla_below for a compiled member and its compiled variants."""
    return ladder.xla_below(a.plan, tuple((below, v.plan, v.registers) for below, v in variants), target)


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
