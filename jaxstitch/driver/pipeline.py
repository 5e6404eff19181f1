"""The compiler pipeline, one pure stage after another: trace -> partition -> plan -> codegen -> NVRTC."""
from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import logging

from ..core import ir
from ..core import ops as opdefs
from ..core.config import Config
from ..core.ops import COMPUTE_BOUND
from ..core.targets import Target
from ..frontend import trace as trace_mod
from ..frontend.transposed_products import readers_by_id
from ..graph import partition as partition_mod
from ..graph import wide_converts
from ..graph.recompute import recompute_cheap_inputs
from ..graph.tails import move_tails
from ..kernels import cache, nvrtc
from ..lowering import codegen
from ..plan import KernelPlan, RegionPlan, Unplannable, cost, plan_region, remote, tile, views
from ..plan import mapping as mapping_mod
from ..plan import scan as scan_mod
from ..plan.candidates import Candidate, candidates, tprs
from ..plan.candidates import narrower as narrower_plan
from ..plan.layout import ReasonKind, place
from ..plan.planner import min_gain
from . import build_times, dumps, fallback, progress
from .program import Compiled, Program

log = logging.getLogger("jaxstitch")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FirstTry:
    """compile_region's first try, made ahead: planned and rendered by prefetch (no source where the
    plan is declined), and its Compiled where _compile_regions waited for the cubin."""

    region: partition_mod.Region
    target: Target
    tuning: mapping_mod.Tuning  # what it was planned with
    plan: RegionPlan
    source: object = None       # codegen.Source
    compiled: Compiled | None = None


# id(region) -> FirstTry, for compile_region to start from (`starting_from`)
_FIRST_TRIES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("jaxstitch_first_tries", default=None)


@contextlib.contextmanager
def starting_from(tries):
    """compile_region in the block starts from these first tries (FirstTry, or None: none made)."""
    token = _FIRST_TRIES.set({id(t.region): t for t in tries if t is not None})
    try:
        yield
    finally:
        _FIRST_TRIES.reset(token)


def _first_try_of(region, target: Target, tuning) -> FirstTry | None:
    first = (_FIRST_TRIES.get() or {}).get(id(region))
    if first is not None and first.region is region and first.target is target and first.tuning == tuning:
        return first
    return None


def compile_region(region, target: Target, cfg: Config) -> Compiled:
    """The first of the planner's candidates (plan/candidates.py) that compiles without spilling,
    where a spilled paired or packed kernel may give way to its narrower plan. A chunked row's
    kernel whose lifted cap leaves one block an SM is kept only if the candidates after it spill
    too: alone on its SM, a block idles the SM at every barrier of its passes (nucleus sampling's
    filter over 32k float32 logits: 512 threads a row, one block an SM, 326 us; 256 threads a row
    within the cap, 282 us on an H100). The first candidate is a FirstTry where one was made
    (`starting_from`)."""
    compiled, tried, lone = None, [], None
    start = _first_try_of(region, target, dataclasses.replace(cfg.tuning, max_tpr=tprs(cfg.tuning.max_tpr)[0]))
    for cand in candidates(region, target, cfg.tuning, first=None if start is None else start.plan):
        if compiled is not None and compiled.spilled:
            m = compiled.plan.kernel.mapping
            tried.append(f"{m.name} (registers for {m.min_blocks} blocks of {m.block} per SM): "
                         f"spills with {compiled.registers} registers")
        if start is not None:  # (prefetch's plan, rendered and perhaps compiled already)
            done = start.compiled
            compiled = done if done is not None else _compile_plan(cand.plan, target, cfg, start.source)
            start = None
        else:
            compiled = _compile_plan(cand.plan, target, cfg)
        if compiled.spilled and not cand.relaxed:
            narrower = _narrower(region, target, cfg, cand)
            if narrower is not None:
                m = compiled.plan.kernel.mapping
                tried.append(f"{m.name} ({m.elems_per_thread} elements a thread): spills with "
                             f"{compiled.registers} registers")
                return dataclasses.replace(narrower, tried=tuple(tried))
        if compiled.spilled:
            continue
        if lone is None and cand.relaxed and _alone_on_its_sm(compiled, target) and cand.max_tpr > 256:
            lone = compiled
            continue
        if lone is not None and compiled is not lone:
            if not compiled.stitched:
                continue  # (declined or failed: the lone kernel stays the answer)
            m, r = lone.plan.kernel.mapping, lone.registers
            tried.append(f"{m.name} ({r} registers a thread: one block of {m.block} per SM)")
        return dataclasses.replace(compiled, tried=tuple(tried))
    if lone is not None:
        return dataclasses.replace(lone, tried=tuple(tried))
    return dataclasses.replace(compiled, tried=tuple(tried))


def _narrower(region, target: Target, cfg: Config, spilled: Candidate) -> Compiled | None:
    """The planner's narrower plan for a spilled candidate (candidates.narrower), compiled, where
    it does not spill; else None."""
    plan = narrower_plan(region, target, cfg.tuning, spilled)
    if plan is None:
        return None
    compiled = _compile_plan(plan, target, cfg)
    return None if compiled.spilled else compiled


def _alone_on_its_sm(compiled: Compiled, target: Target) -> bool:
    """A stitched chunked-row kernel whose registers leave room for one block an SM."""
    kernel = compiled.plan.kernel
    return (compiled.stitched and isinstance(kernel, KernelPlan) and kernel.mapping.chunks > 1
            and target.blocks_by_registers(kernel.mapping.block, compiled.registers) < 2)


def _compile_plan(plan: RegionPlan, target: Target, cfg: Config, source=None) -> Compiled:
    """`source`: the plan's kernel rendered already (codegen.Source), else rendered here."""
    if not plan.stitched:
        return Compiled(plan, None, None, None, None)
    try:
        source = codegen.render(plan.kernel) if source is None else source
    except Unplannable as e:  # (raised by a plan/ helper rendering calls, such as layout.row_axes)
        return Compiled(plan, None, None, None, f"codegen: {e}")
    except codegen.Unrenderable as e:  # (a planner bug: planner.unrenderable lets no such plan through)
        if cfg.strict:
            raise
        return Compiled(plan, None, None, None, fallback.region_failed("codegen", plan.region.ops, "", e))
    source = dumps.overridden(source, cfg.override_dir)  # (JAXSTITCH_OVERRIDE_DIR's hand-edited kernels)
    lines = _lines(source)
    if lines > MAX_SOURCE_LINES:
        why = f"its kernel is {lines} lines of CUDA C, more than the {MAX_SOURCE_LINES} NVRTC compiles in seconds"
        log.info("region %d falls back to XLA: %s", plan.region.id, why)
        return Compiled(plan, source.code, None, None, why)
    try:
        with build_times.stage("nvrtc"):  # (waiting on it: it runs in the background, see stage)
            key, cubin, res = cache.get_cubin(source.code, target.arch, cfg.cache_dir, cfg.nvrtc_seconds)
    except nvrtc.CompileTimeout as e:  # (a runaway kernel: not a bug, a region too big to compile)
        why = f"NVRTC did not finish the kernel's {lines} lines within {e.seconds:g} s (JAXSTITCH_NVRTC_SECONDS)"
        log.warning("region %d falls back to XLA: %s", plan.region.id, why)
        return Compiled(plan, source.code, None, None, why)
    except nvrtc.CompileError as e:  # (our own source failing to compile is a jaxstitch bug)
        if cfg.strict:
            raise
        why = fallback.region_failed("NVRTC", plan.region.ops, "", e)
        return Compiled(plan, source.code, None, None, why)
    if res.spill_bytes > 0:
        why = (f"the kernel spills {res.spill_bytes} bytes of registers ({res.registers} used) "
               "in every thread mapping tried")
        log.info("region %d falls back to XLA: %s", plan.region.id, why)
        return Compiled(plan, source.code, key, None, why, spilled=True, registers=res.registers)
    warps = _resident_warps(plan.kernel, res.registers, target)
    if warps is not None and warps < MIN_RESIDENT_WARPS and cfg.tuning.min_gain_pct is None:
        why = (f"the kernel needs {res.registers} registers a thread: {warps} warps an SM, too few to hide "
               f"memory latency (fewer than {MIN_RESIDENT_WARPS})")
        log.info("region %d falls back to XLA: %s", plan.region.id, why)
        return Compiled(plan, source.code, key, None, why, registers=res.registers)
    if isinstance(plan.kernel, KernelPlan) and cfg.tuning.one_wave:
        kernel = dataclasses.replace(plan.kernel, mapping=mapping_mod.one_wave(plan.kernel.mapping, res.registers, target))
        plan = dataclasses.replace(plan, kernel=kernel)
    if isinstance(plan.kernel, tile.TilePlan):  # one wave of blocks, as many as the cubin lets reside
        kernel = dataclasses.replace(plan.kernel, mapping=tile.one_wave(plan.kernel.mapping, res.registers, target))
        plan = dataclasses.replace(plan, kernel=kernel)
    return Compiled(plan, source.code, key, cubin, None, registers=res.registers)


# A row kernel with fewer warps resident per SM loses to XLA: the rotary embedding's fwd+bwd in
# bfloat16, 255 registers a thread (8 warps): 0.66x on an H100; in float32 with 16 warps: 1.15x.
MIN_RESIDENT_WARPS = 16

# NVRTC's time grows with a kernel's length: the 588 kernels of the suite, BERT, GPT, DIEN and the
# zoo are at most 1,598 lines and compile in about a second each; a random-bit region of 3,316 ops
# rendered 10,335 lines that NVRTC took 90 s over before ptxas found it spilling. Longer than this
# is not compiled (JAXSTITCH_NVRTC_SECONDS bounds the time of what is).
MAX_SOURCE_LINES = 5000


def _lines(source) -> int:
    return source.code.count("\n")


def _resident_warps(kernel, registers: int, target: Target) -> int | None:
    """Warps of a row kernel (KernelPlan) one SM holds with `registers` a thread; None for others."""
    if not isinstance(kernel, KernelPlan) or not registers:
        return None
    return target.blocks_by_registers(kernel.mapping.block, registers) * kernel.mapping.block // 32


# Whether a region plans as one kernel, by its structure (partition.structure): partitioning asks
# thousands of times, mostly of the same few shapes of region (BERT-base's step: 2134 regions
# planned, ~2.4 s of its ~5.6 s build on the CPU machine).
_FITS: dict[tuple, bool] = {}
_FITS_MAX = 1 << 16


def _fits_one_kernel(region, target: Target, strict: bool = False) -> bool:
    """Whether one kernel can hold the region on `target`: in a row space, or as a batch of tiles.
    Remembered by the region's structure and the target. An internal error in planning it says no
    (`strict`: raises)."""
    try:
        key = _fits_key(region, target)
        known = _FITS.get(key)
    except (TypeError, ValueError):  # (a parameter that cannot be hashed or compared: planned every time)
        return _plans_or_not(region, target, strict)
    if known is None:
        known = _put_fit(key, _plans_or_not(region, target, strict))
    return known


def _fits_key(region, target: Target) -> tuple:
    """A region's key in _FITS: the target and the region's structure (TypeError or ValueError
    where a parameter cannot be hashed or compared)."""
    return target.name, partition_mod.structure(region)


def _put_fit(key: tuple, answer: bool) -> bool:
    """`answer` in _FITS under `key` (emptied first where full); returns it."""
    if len(_FITS) >= _FITS_MAX:
        _FITS.clear()
    _FITS[key] = answer
    return answer


_KEYED: set[tuple] = set()  # primitives of regions remembered in _FITS by _Fits


class _Fits:
    """`_fits_one_kernel` for one partition, a region's structure key made only once a second region
    of the same primitives comes (then for both): a key of hundreds of ops costs about half of
    planning them, and most such regions are asked once (GPT's merge across views grows regions
    of 300-960 ops: 2344 keys, 4.6 s of its 17 s partition)."""

    def __init__(self, target: Target, strict: bool):
        self.target, self.strict = target, strict
        self.unkeyed: dict[tuple, tuple] = {}  # primitives -> (region, answer): asked once so far

    def __call__(self, region) -> bool:
        prims = tuple((op.prim, op.outputs[0].shape if op.outputs else ()) for op in region.ops)
        if prims not in _KEYED:
            first = self.unkeyed.pop(prims, None)
            if first is None:
                answer = _plans_or_not(region, self.target, self.strict)
                self.unkeyed[prims] = (region, answer)
                return answer
            _remember(*first, self.target)
            if len(_KEYED) >= _FITS_MAX:
                _KEYED.clear()
            _KEYED.add(prims)
        return _fits_one_kernel(region, self.target, self.strict)

    def refuses(self, parts) -> bool:
        """The partitioner's quick no for a union it has not built (plan/views.refused_union)."""
        return views.refused_union(parts)


def _remember(region, answer: bool, target: Target):
    """`answer` in _FITS under the region's structure and the target (not where it cannot be hashed)."""
    try:
        key = _fits_key(region, target)
        if key not in _FITS:  # (hashing the key may raise too)
            _put_fit(key, answer)
    except (TypeError, ValueError):
        pass


def _plans_or_not(region, target: Target, strict: bool) -> bool:
    try:
        return _plans_as_one_kernel(region, target)
    except Exception as e:  # noqa: BLE001 - (a planner bug: the partition cuts around it)
        if strict:
            raise
        log.debug("planning region of %s raised %s: %s", fallback.key_ops(region.ops), type(e).__name__, e)
        return False


def _plans_as_one_kernel(region, target: Target) -> bool:
    """A row space places it, or a batch of tiles holds it. With a column or whole-array reduction
    the row's mapping decides too (no column partials over rows walked in chunks), so such a region
    is planned in full (a cross-entropy's backward meeting its bias gradient over a vocabulary)."""
    try:
        if not views.never_placed(region):
            place(views.sink(region))
            if any(opdefs.is_grid_reduction(op) for op in region.ops):
                return plan_region(region, target).kernel is not None
            return True
    except Unplannable:
        pass
    try:
        tile.plan_tile(region, target)
        return True
    except Unplannable:
        return False


def traced_with(fun, flat_args, in_tree, static: dict | None, cfg: Config) -> trace_mod.Traced:
    """`fun`'s trace with the rewrites `cfg` asks for (its tuning's and XLA's excess precision)."""
    return trace_mod.trace(fun, flat_args, in_tree, static, scatters=bool(cfg.tuning.scatters),
                           wide_scatters=bool(cfg.tuning.wide_scatters),
                           merge_products=bool(cfg.tuning.merge_products),
                           batched_folds=cfg.tuning.batched_folds,
                           product_concats=bool(cfg.tuning.product_concats),
                           excess_precision=cfg.excess_precision)


def build(fun, flat_args, in_tree, target: Target, cfg: Config, static: dict | None = None) -> Program:
    with build_times.stage("trace"):
        traced = traced_with(fun, flat_args, in_tree, static, cfg)
    return complete(stage(traced, target, cfg), target, cfg)


@dataclasses.dataclass(frozen=True, eq=False)
class Staged:
    """A traced program, partitioned, its kernels compiling in the background (see stage)."""

    traced: trace_mod.Traced
    partition: partition_mod.Partition
    # region id -> prefetch's FirstTry: compile_region's first try, not planned again
    first: dict = dataclasses.field(default_factory=dict)


def stage(traced: trace_mod.Traced, target: Target, cfg: Config,
          regions_of: partition_mod.Partition | None = None) -> Staged:
    """Partition (or take `regions_of`'s regions: the same program at other sizes), and start NVRTC
    on every region's first plan in the background (NVRTC releases the GIL): a program's kernels
    then compile side by side, and beside whatever is planned before `complete` (families.py plans
    a second sample meanwhile)."""
    with build_times.stage("partition"):
        if cfg.tuning.wide_converts:
            traced = widened(traced)
        if regions_of is not None:
            part = partition_mod.resized(regions_of, traced.graph)
        else:
            cuts = partition_mod.Cuts(at_reduced=not cfg.tuning.stitch, at_grid=not cfg.tuning.grid)
            fits = _Fits(target, cfg.strict)
            part = partition_mod.partition(traced.graph, fits=fits, cuts=cuts)
            if cfg.tuning.tails:
                part = move_tails(traced.graph, part, fits)
            if cfg.tuning.recompute:
                part = recompute_cheap_inputs(traced.graph, part, fits,
                                              unread_writes=cfg.tuning.recompute >= 2,
                                              leaf_chains=cfg.tuning.recompute >= 3)
    with build_times.stage("plan"):
        first = {r.id: prefetch(r, target, cfg) for r in part.regions}
    return Staged(traced, part, {k: v for k, v in first.items() if v is not None})


def complete(staged: Staged, target: Target, cfg: Config, bodies: bool = True) -> Program:
    """The program: every region compiled (or left to XLA, with the reason), and with `bodies` its
    control-flow bodies planned as programs of their own; dumped if asked."""
    program = _complete(staged, target, cfg, bodies)
    if cfg.dump_dir:
        _dump(program, cfg.dump_dir)
    return program


def widened(traced: trace_mod.Traced) -> trace_mod.Traced:
    """`traced` with its conversions to bfloat16 that need no rounding in our kernels marked
    (wide_converts.py; JAXSTITCH_TUNE=wide_converts=1), counted among the report's rewritten
    equations."""
    graph = wide_converts.widen(traced.graph)
    kept = sum(1 for op in graph.ops if op.param(wide_converts.KEEP_FLOAT))
    if not kept:
        return traced
    return dataclasses.replace(traced, graph=graph, rewritten=tuple(sorted(
        dict(traced.rewritten, **{wide_converts.REPORTED: kept}).items())))


def prefetch(region, target: Target, cfg: Config) -> FirstTry | None:
    """What compile_region tries first, compiling in the background; returned for compile_region to
    start from, None after an error (compile_region plans again, meets it and reports it)."""
    tuning = dataclasses.replace(cfg.tuning, max_tpr=tprs(cfg.tuning.max_tpr)[0])
    try:
        plan = plan_region(region, target, tuning)
        if not plan.stitched:
            return FirstTry(region=region, target=target, tuning=tuning, plan=plan)
        source = codegen.render(plan.kernel)
    except Exception:  # noqa: BLE001 - (declined, or a bug that compile_region meets again and reports)
        return None
    if _lines(source) <= MAX_SOURCE_LINES:  # (_compile_plan declines it without compiling)
        cache.prefetch(source.code, target.arch, cfg.cache_dir, cfg.nvrtc_seconds)
    return FirstTry(region=region, target=target, tuning=tuning, plan=plan, source=source)


def _build(traced: trace_mod.Traced, target: Target, cfg: Config) -> Program:
    return _complete(stage(traced, target, cfg), target, cfg)


def _complete(staged: Staged, target: Target, cfg: Config, bodies: bool = True) -> Program:
    traced, part = staged.traced, staged.partition
    with build_times.stage("plan"):
        regions = _folded_into_products(_compile_regions(part.regions, traced, target, cfg, staged.first), traced)
        if cfg.tuning.remote:
            regions = _or_unchanged(lambda: stitch_remote(traced.graph, regions, target, cfg), regions,
                                    "remote stitching", cfg)
        scans = plan_scans(traced, 1 + max((c.plan.region.id for c in regions), default=0), target, cfg)
    taken = {c.plan.region.ops[0].index for c in scans if c.stitched}
    with build_times.apart("bodies"):
        planned = tuple((i, key, _build(_trace_body(closed, cfg), target, cfg))
                        for i, e in enumerate(traced.eqns if bodies else ()) if i not in taken
                        for key, closed in trace_mod.bodies(e))
    return Program(traced, part, regions + scans, target, planned)


def _compile_regions(regions, traced: trace_mod.Traced, target: Target, cfg: Config,
                     first: dict) -> tuple[Compiled, ...]:
    """_compiled_or_xla of each region, in order, every first try waited for here. A region whose
    first kernel spills goes on to its retries (compile_region) in a thread beside the regions
    after it: one after another, BERT's cold build waited ~13 s on its 27 retries (~0.5 s of NVRTC
    each, CPU machine), each started only once the loop reached its region; side by side they
    overlap where cores are free. Regions whose first kernels are one source retry in turn, the
    later ones finding the first one's cubins."""
    out: list = []
    chains: dict[str, concurrent.futures.Future] = {}
    with starting_from(first.values()), \
            concurrent.futures.ThreadPoolExecutor(cache.THREADS, thread_name_prefix="jaxstitch-retries") as pool:
        tries = _FIRST_TRIES.get()
        for r in progress.planning(regions):
            f = tries.get(id(r))
            done = _first_try(f, target, cfg) if f is not None and f.region is r else None
            if done is not None:
                tries[id(r)] = f = dataclasses.replace(f, compiled=done)
            if done is None or not done.spilled:
                out.append(_compiled_or_xla(r, traced, target, cfg))
                continue
            key = f.source.code
            run = contextvars.copy_context().run  # (the first tries; build_times.unmeasured: no clock)
            chains[key] = pool.submit(run, _after, chains.get(key), build_times.unmeasured, _compiled_or_xla,
                                      r, traced, target, cfg)
            out.append(chains[key])
        with build_times.stage("nvrtc"):  # (the retries left: mostly NVRTC)
            return tuple(c.result() if isinstance(c, concurrent.futures.Future) else c for c in out)


def _first_try(first: FirstTry, target: Target, cfg: Config) -> Compiled | None:
    """The first try compiled (waiting for its cubin); None after an error, which compile_region
    meets again and reports (or raises)."""
    try:
        return _compile_plan(first.plan, target, cfg, first.source)
    except Exception:  # noqa: BLE001
        return None


def _after(before: concurrent.futures.Future | None, fn, *args):
    """fn(*args) once `before` (if any) is done."""
    if before is not None:
        concurrent.futures.wait([before])
    return fn(*args)


FOLDED = "a transpose of the two minor axes only matrix products read: XLA folds it into them (no kernel)"


def _folded_into_products(regions: tuple[Compiled, ...], traced: trace_mod.Traced) -> tuple[Compiled, ...]:
    """The regions left to XLA that are a lone transpose every reader of which, a `dot_general`,
    takes it as its operand's layout, marked as no kernel (the report had counted one): XLA's
    TransposeFolding folds them where its GPU predicate (CanFoldTransposeOperandIntoDot) holds: the
    two minor axes swapped, the product's batch axes the leading ones, one of the two contracted
    (`x @ w.T`). (A transpose of a transpose is composed in the trace: composed_transposes.py.)"""
    readers = None
    out = []
    for c in regions:
        ops = c.plan.region.ops
        if not c.stitched and len(ops) == 1 and ops[0].prim == "transpose" and _minor_swap(ops[0]):
            readers = readers if readers is not None else _readers(traced)
            if all(_folds_into(ops[0], r) for r in readers.get(ops[0].outputs[0].id, [None])):
                plan = RegionPlan(region=c.plan.region, kernel=None, estimate=cost.Estimate(0, 0.0, 0, 0, 0.0), reason=FOLDED)
                c = dataclasses.replace(c, plan=plan, error=None)
        out.append(c)
    return tuple(out)


def _readers(traced: trace_mod.Traced) -> dict[int, list]:
    """The ops reading each value, by id (None for a program result)."""
    out = readers_by_id(traced.graph.ops)
    for a in traced.graph.outputs:
        if isinstance(a, ir.Value):
            out[a.id].append(None)
    return out


def _minor_swap(op: ir.Op) -> bool:
    perm = tuple(op.param("permutation", ()))
    n = len(perm)
    return n >= 2 and perm == tuple(range(n - 2)) + (n - 1, n - 2)


def _folds_into(transpose: ir.Op, reader: ir.Op | None) -> bool:
    """Whether `reader` is a product that takes `transpose`'s result as an operand whose batch axes
    lead and one of whose two minor axes it contracts (XLA's GPU TransposeFolding predicate)."""
    if reader is None or reader.prim != "dot_general":
        return False
    (contracting, batch) = reader.param("dimension_numbers")
    value, n, taken = transpose.outputs[0], len(transpose.outputs[0].shape), False
    for k, a in enumerate(reader.inputs[:2]):
        if isinstance(a, ir.Value) and a.id == value.id:
            if tuple(batch[k]) != tuple(range(n - 2)) or len(contracting[k]) != 1 \
                    or contracting[k][0] < n - 2:
                return False
            taken = True
    return taken


def _compiled_or_xla(region, traced: trace_mod.Traced, target: Target, cfg: Config) -> Compiled:
    """compile_region, or after an internal error (a jaxstitch bug) the region left to XLA, with a
    warning naming it (fallback.py); JAXSTITCH_STRICT raises."""
    try:
        return compile_region(region, target, cfg)
    except Exception as e:  # noqa: BLE001 - a planner or codegen bug must leave the region to XLA
        if cfg.strict:
            raise
        where = trace_mod.source_line(traced.eqns[region.ops[0].index]) if region.ops else ""
        why = fallback.region_failed("planning", region.ops, where, e)
        return Compiled(RegionPlan(region=region, kernel=None, estimate=None, reason=why), None, None, None, why)


def _or_unchanged(step, unchanged, what: str, cfg: Config):
    """`step()`, or `unchanged` after an internal error in it (warned about; JAXSTITCH_STRICT raises)."""
    try:
        return step()
    except Exception as e:  # noqa: BLE001
        if cfg.strict:
            raise
        fallback.region_failed(what, (), "", e)
        return unchanged


def plan_scans(traced: trace_mod.Traced, first_id: int, target: Target, cfg: Config) -> tuple[Compiled, ...]:
    """Each `lax.scan` of the program as one persistent kernel (plan/scan.py), or the reason it
    stays an XLA loop (whose body is then planned on its own)."""
    if not cfg.tuning.scans:
        return ()
    out = []
    for op, eqn in zip(traced.graph.ops, traced.eqns):
        if op.prim == "scan":
            inputs = tuple(dict.fromkeys(a for a in op.inputs if isinstance(a, ir.Value)))
            region = partition_mod.Region(first_id + len(out), (op,), inputs, tuple(op.outputs))
            out.append(compile_scan(region, eqn, target, cfg))
    return tuple(out)


def compile_scan(region, eqn, target: Target, cfg: Config) -> Compiled:
    def declined(why, kernel=None, est=None, kind=None):
        log.info("scan %d stays an XLA loop: %s", region.id, why)
        return Compiled(RegionPlan(region=region, kernel=kernel, estimate=est, reason=why, reason_kind=kind),
                        None, None, None, None)

    body = trace_mod.scan_body(eqn)
    if body is None:
        return declined("its body captures arrays")
    try:
        kernel, est = scan_mod.plan_scan(region, body, target, bool(cfg.tuning.scan_sums))
    except Unplannable as e:
        return declined(f"one kernel cannot hold it: {e}", kind=e.kind)
    except Exception as e:  # noqa: BLE001 - a planner bug must leave the loop to XLA, not break the program
        log.warning("scan %d stays an XLA loop: planning failed: %s: %s", region.id, type(e).__name__, e)
        return declined(f"planning failed: {type(e).__name__}: {e}")
    if est.speedup < min_gain(cfg.tuning):
        return declined(f"estimated {est.us:.1f} us as one kernel vs {est.xla_us:.1f} us as XLA's loop", kernel, est,
                        ReasonKind.COST)
    return _compile_plan(RegionPlan(region=region, kernel=kernel, estimate=est, reason=None), target, cfg)


def _trace_body(closed, cfg: Config) -> trace_mod.Traced:
    avals = trace_mod.in_avals(closed)
    return trace_mod.trace(trace_mod.jaxpr_as_fun(closed), avals, trace_mod.positional_tree(avals),
                           excess_precision=cfg.excess_precision)


def stitch_remote(graph, regions: tuple[Compiled, ...], target: Target, cfg: Config) -> tuple[Compiled, ...]:
    """Remote stitching (plan/remote.py): flat regions left to XLA that XLA could not fuse with their
    neighbours either, launched together where the cost model expects a gain. The merged regions
    replace their members."""
    ends = _Ends(graph, regions)
    candidates = [c.plan.region for c in regions if ends.remote_candidate(c)]
    merged: dict[int, Compiled] = {}
    next_id = 1 + max((c.plan.region.id for c in regions), default=0)
    for group in remote.groups(graph, tuple(c.plan.region for c in regions), candidates):
        kernel, est = remote.plan_remote(group, next_id, target, ends.spent(group), ends.program_inputs)
        next_id += 1
        if est.speedup < min_gain(cfg.tuning):
            log.info("%d independent chains stay with XLA: estimated %.1f us as one kernel vs %.1f us",
                     len(group), est.us, est.xla_us)
            continue
        compiled = _compile_plan(RegionPlan(region=kernel.region, kernel=kernel, estimate=est, reason=None), target, cfg)
        if compiled.stitched:
            merged.update((r.id, compiled) for r in group)
    out, placed = [], set()
    for c in regions:
        m = merged.get(c.plan.region.id)
        if m is None:
            out.append(c)
        elif m.plan.region.id not in placed:
            placed.add(m.plan.region.id)
            out.append(m)
    return tuple(out)


class _Ends:
    """Where a region's inputs come from and its results go, as far as XLA's fusion is concerned."""

    def __init__(self, graph, regions: tuple[Compiled, ...]):
        stitched = [c.plan.region for c in regions if c.stitched]
        # values XLA does not fuse into (or out of) a neighbouring loop: program inputs, results of
        # compute-bound ops (library calls) and of our kernels
        self.program_inputs = frozenset(v.id for v in graph.inputs)
        self.program_outputs = {v.id for v in graph.outputs if isinstance(v, ir.Value)}
        self.unfused = set(self.program_inputs)
        self.unfused |= {o.id for op in graph.ops if op.prim in COMPUTE_BOUND for o in op.outputs}
        self.unfused |= {v.id for r in stitched for v in r.outputs}
        stitched_ops = {op.index for r in stitched for op in r.ops}
        self.readers: dict[int, set[int]] = {}  # value -> every op reading it
        self.fusing_readers: dict[int, set[int]] = {}  # value -> ops XLA could fuse it into
        for op in graph.ops:
            fusing = op.prim not in COMPUTE_BOUND and op.index not in stitched_ops
            for a in op.inputs:
                if isinstance(a, ir.Value):
                    self.readers.setdefault(a.id, set()).add(op.index)
                    if fusing:
                        self.fusing_readers.setdefault(a.id, set()).add(op.index)

    def spent(self, members: list) -> frozenset[int]:
        """Inputs of the members that one member alone reads (and no program output is): another
        reader, in another block of the merged kernel, could see it overwritten."""
        return frozenset(v.id for r in members for v in r.inputs if v.id not in self.program_outputs
                         and self.readers.get(v.id, set()) <= {op.index for op in r.ops})

    def remote_candidate(self, c: Compiled) -> bool:
        """A flat region left to XLA (not for an error, not cut from a neighbour) whose inputs and
        results XLA would not fuse with other ops anyway."""
        r = c.plan.region
        if c.stitched or c.error or r.cut or remote.flat_size(r) is None:
            return False
        if not all(v.size == 1 or v.id in self.unfused for v in r.inputs):
            return False
        own = {op.index for op in r.ops}
        return all(self.fusing_readers.get(v.id, set()) <= own for v in r.outputs)


def _dump(program: Program, dump_dir: str):
    """The program's sources, plans and report in a folder of its own in `dump_dir` (dumps.py)."""
    from .report import make_report

    dumps.write(program, str(make_report(program)), dump_dir)
