"""Plan one region: place its values, pick the thread mapping, lay out the grid workspace, cost it."""
from __future__ import annotations

import dataclasses
import math

from ..core import ir
from ..core import ops as opdefs
from ..core.targets import Target
from ..graph.partition import Region
from . import cost, diamonds, pairs, tile, views
from . import mapping as mapping_mod
from .layout import COL, FULL, GATHER, MEMORY, PAIR_HALF, PAIR_SWAP, Layout, ReasonKind, Unplannable, place
from .mapping import Mapping
from .online import OnlineSum, find_online_sums, sum_ids
from .prefixes import Prefix, find_prefixes
from .shifts import pull_out


@dataclasses.dataclass(frozen=True)
class GridReduction:
    """A value reduced over the whole grid: per-block partials at `offset` (floats) in the workspace."""

    value_id: int
    offset: int
    size: int


@dataclasses.dataclass(frozen=True)
class StashSlot:
    """A row input kept in the block's dynamic shared memory at `offset` bytes (of each stage's buffer:
    a chunked row's stash, or the async-copy stages a row group is loaded through)."""

    value_id: int
    offset: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelPlan:
    """A row kernel, decided: where each value lives (`layout`), the thread mapping, the grid
    workspace's reductions and the stash. Codegen renders it as it is."""

    region: Region
    layout: Layout
    mapping: Mapping
    grid_reductions: tuple[GridReduction, ...]
    workspace_bytes: int
    stash: tuple[StashSlot, ...] = ()
    # Rows split over blocks: each row reduction's per-(row, slice) partials in the workspace, combined
    # by every block of the row after a grid barrier.
    split_partials: tuple[GridReduction, ...] = ()
    # Row sums of exp(x - max) reduced in the max's pass (plan/online.py).
    online: tuple[OnlineSum, ...] = ()
    # exp as the hardware's ex2.approx(x * log2 e): see fast_exp.
    fast_exp: bool = False
    # Row reductions whose row-constant shifts were taken out (plan/shifts.py), and the row
    # reduction levels of the region as traced, which XLA runs (None: the same as the layout's).
    shifts: int = 0
    xla_levels: int | None = None
    passes: int = 1  # over the rows' elements (cost.chunk_passes)
    # Row reductions XLA runs apart from the ops reading their result back (plan/diamonds.py).
    xla_unfused: int = 0
    # Why a pairing of the row's halves that plan/pairs.py found was not taken (None: none found, or taken).
    unpaired: str | None = None
    # Columns of a grid-wide column reduction a block finishes together after the barrier.
    col_group: int = 8
    # Staged row inputs needed only on a prefix of each row (a causal mask: plan/prefixes.py).
    prefixes: tuple[Prefix, ...] = ()

    def __post_init__(self):
        if self.mapping.cooperative and self.workspace_bytes <= 0:
            raise ValueError("a cooperative kernel takes a workspace: workspace_bytes must be positive")

    @property
    def stage_bytes(self) -> int:
        return self.mapping.smem_bytes // max(1, self.mapping.stages)

    @property
    def description(self) -> str:
        """The thread mapping's name, and what else shapes the kernel's passes over a row."""
        weighted = sum(len(o.weighted) for o in self.online)
        return (self.mapping.name + (f", online softmax x{len(self.online)}" if self.online else "")
                + (f" with {weighted} weighted sum{'s' if weighted > 1 else ''}" if weighted else "")
                + (f", shifts out of {self.shifts} reductions" if self.shifts else "")
                + (", fast exp" if self.fast_exp else ""))

    @property
    def scheme(self) -> str:
        """AStitch's name for where one-to-many values live: registers, shared or global memory."""
        if self.grid_reductions:
            return "global"
        has_row_reduce = any(p.level > 0 for p in self.layout.values)
        return "regional" if has_row_reduce and self.mapping.tpr > 32 else "local"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RegionPlan:
    """A region's plan: its kernel and estimate, and `reason` where it stays with XLA (then
    `reason_op` is the traced equation the reason is about, where it names one, and `reason_kind`
    what kind of obstacle it is, for grouping reasons without reading their text)."""

    region: Region
    kernel: KernelPlan | tile.TilePlan | None
    estimate: cost.Estimate | None
    reason: str | None
    reason_op: int | None = None  # the traced equation the reason names, where it names one
    # An Unplannable's kind, or COST for the cost model's decline; None when stitched, or where the
    # reason is the pipeline's own (a scan body that captures arrays, a planning bug).
    reason_kind: ReasonKind | None = None

    def __post_init__(self):
        if self.reason is None:
            if self.kernel is None or self.estimate is None:
                raise ValueError(f"region {self.region.id}: a plan left to XLA says why (reason); a stitched "
                                 "one has a kernel and an estimate")
            if self.reason_op is not None or self.reason_kind is not None:
                raise ValueError(f"region {self.region.id}: reason_op and reason_kind belong to a reason")

    @property
    def stitched(self) -> bool:
        return self.kernel is not None and self.reason is None


def _live_arrays(region: Region, layout: Layout) -> int:
    """Arrays a thread holds across a row: its wide inputs and column accumulators (everything else
    is recomputed per phase by codegen), plus two for temporaries."""
    count = 2
    for v in region.inputs:
        if layout.of(v).storage in (FULL, COL):
            count += 1
    for op in region.ops:
        if opdefs.is_grid_reduction(op) and layout.of(op.outputs[0]).declared == COL:
            count += 1
        elif op.prim == GATHER and layout.of(op.outputs[0]).storage in (FULL, COL):
            count += 1
    return count


def _gathered_bytes(region: Region, layout: Layout) -> int:
    """Bytes the kernel's gathers read from inputs it does not also read directly: each such input's
    gathered elements, at most its size (gathers of the same rows meet in L1 and L2)."""
    per_input: dict = {}
    for op in region.ops:
        if op.prim == GATHER and layout.of(op.inputs[0]).storage == MEMORY:
            src = op.inputs[0]
            per_input[src] = min(src.size * src.itemsize, per_input.get(src, 0) + op.outputs[0].size * src.itemsize)
    return sum(per_input.values())


# Ops that issue no instructions of their own: casts fold into loads and stores, layout ops into
# index arithmetic (which the gathers' count carries).
_FREE_OPS = opdefs.LAYOUT | {"convert_element_type", "copy", PAIR_SWAP, PAIR_HALF}


def _computing_ops(region: Region) -> int:
    """The region's ops that compute, for a gather kernel's issue-bound time (calibration.gather_ops_per_sm_us)."""
    return sum(1 for op in region.ops if op.prim not in _FREE_OPS)


def _integer_ops(region: Region, layout: Layout) -> int:
    """Ops computing a full-size integer value: an issue-bound term where there are many (the
    random bits of a dropout, calibration.our_int_ops_per_sm_us)."""
    return sum(1 for op in region.ops if op.prim not in _FREE_OPS
               and any(o.dtype in ("int32", "uint32") and layout.of(o).storage == FULL for o in op.outputs))


def fast_exp(region: Region) -> bool:
    """Whether the region's exps may use the hardware's ex2.approx(x * log2 e), 2 instructions instead
    of expf's 8, and its erfcs a Chebyshev fit through it (js_erfc_fast, ~1e-6 relative): when every
    floating input is half precision. The exp's error, at most ~2^-22 + |x| 2^-24 relative (under
    1e-5 over the whole range exp is finite in), is far under the 2^-9 (bfloat16) or 2^-12 (float16)
    the inputs are known to, so no output moves by more than its inputs' rounding makes it
    uncertain. Results below 2^-126 flush to zero. A float32 row statistic (one value a row of
    the largest input) does not count: read beside half-precision rows (a softmax's sum,
    recompute._unrounds), it is no more exact than the rows it was made from; a float32 parameter
    (a column vector) does."""
    full = max((v.shape for v in region.inputs), key=math.prod, default=())
    floats = [v.dtype for v in region.inputs if v.dtype in ir.FLOAT_DTYPES
              and not (v.dtype == "float32" and full and v.shape in (full[:-1], full[:-1] + (1,)))]
    return bool(floats) and all(d in ir.HALF_DTYPES for d in floats) and any(op.prim in ("exp", "erfc")
                                                                         for op in region.ops)


def plan_region(region: Region, target: Target, tuning: mapping_mod.Tuning = mapping_mod.Tuning(),
                relaxed: bool = False) -> RegionPlan:
    """`tuning` overrides the mapping heuristics (`tuning.max_tpr` caps threads per row); `relaxed`
    drops the register cap of the launch bounds: a mapping whose kernel spills is planned again with
    more registers per thread (candidates.py)."""
    original = region
    try:
        region = views.sink(region)
    except Unplannable as e:  # (a transpose of a tile's two axes: through shared memory, plan/tile.py)
        return _plan_tile(original, target, tuning, relaxed, e)
    online = find_online_sums(region.ops) if tuning.online else ()
    try:
        layout = place(region, sum_ids(online))
    except Unplannable as e:
        return _plan_tile(original, target, tuning, relaxed, e)
    sunk = region
    region, online, layout, shifts, passes = _fewer_passes(region, online, layout, tuning)
    try:
        grid_ops = [op for op in region.ops if opdefs.is_grid_reduction(op)]
        if any(op.prim in opdefs.PICKING for op in grid_ops):
            raise Unplannable(ReasonKind.OP, "argmax/argmin/variadic reduce over the whole grid")
        region, layout, mp, unpaired = _paired_or_not(region, layout, online, passes, target, tuning)
        row_inputs = [v for v in region.inputs if layout.of(v).storage == FULL]
        row_reductions = [op for op in region.ops if opdefs.is_row_reduction(op)]
        scans = [op for op in region.ops if op.prim in opdefs.SCANS]
        if tuning.factors == 1 and shifts and mp.chunks == 1 and mp.splits == 1:
            # A row held in registers gains nothing from fewer passes, and a third online sum
            # measured 1-2% slower there (H100, softmax fwd+bwd of 4096 and of 64 columns).
            return plan_region(original, target, dataclasses.replace(tuning, factors=0), relaxed)
        if mp.chunks > 1 and len({op.param("reverse") for op in scans}) > 1:
            raise Unplannable(ReasonKind.OP, f"scans in both directions along rows of {mp.n_cols} walked in "
                              f"{mp.chunks} chunks (a pass over the chunks runs one way)")
        # A scan's warp totals take static shared memory beside a stash (4 bytes a warp and vector
        # slot, for each of float and int): within the reserve the stash leaves for it.
        scan_bytes = 8 * mp.rows_per_block * (mp.tpr // 32) * mp.vpt if scans and mp.tpr > 32 else 0
        if mp.smem_bytes and scan_bytes > mapping_mod.STATIC_SMEM_RESERVE // 2:
            raise Unplannable(ReasonKind.RESOURCES, f"a scan's warp totals need {scan_bytes} bytes of shared "
                              f"memory beside a {mp.smem_bytes}-byte stash")
        if relaxed:
            mp = dataclasses.replace(mp, min_blocks=1)
        if (tuning.serpentine and passes > 1 and mp.chunks > 1 and not scans
                and (mp.stash == mapping_mod.GLOBAL or mp.stashed_chunks < mp.chunks)):
            mp = dataclasses.replace(mp, serpentine=True)
        stash, at = [], 0
        if mp.smem_bytes:
            for v in row_inputs:
                stash.append(StashSlot(v.id, at))
                at += mapping_mod.stash_slot_bytes(mp.block, mp.stashed_chunks, mp.vpt, mp.vec, v.itemsize)
        reductions, offset = [], 0  # (the grid barrier keeps its state in the module: csrc_templates)
        for op in grid_ops:
            size = layout.n_cols if layout.of(op.outputs[0]).declared == COL else 1
            reductions.append(GridReduction(op.outputs[0].id, offset, size))
            offset += mp.grid_cap * size
        splits = []
        if mp.splits > 1:  # a slot per block, twice (by barrier parity): the same for any row count
            for op in row_reductions:
                splits.append(GridReduction(op.outputs[0].id, offset, 2 * mp.grid_cap))
                offset += 2 * mp.grid_cap
        # (a cooperative kernel takes a workspace pointer even where nothing crosses blocks: rows
        # split only for parallelism; without the buffer its launch lacked a parameter)
        ws = max(offset * 4, 16) if mp.cooperative else 0
        xla_levels = cost.reduction_levels(place(sunk, frozenset())) if online or shifts else None
        kernel = KernelPlan(region=region, layout=layout, mapping=mp, grid_reductions=tuple(reductions),
                            workspace_bytes=ws, stash=tuple(stash), split_partials=tuple(splits), online=online,
                            fast_exp=bool(tuning.fast_exp) and fast_exp(region), shifts=shifts,
                            xla_levels=xla_levels, passes=passes,
                            xla_unfused=diamonds.unfused_reductions(original) if tuning.diamonds else 0,
                            unpaired=unpaired, col_group=tuning.col_group or column_group(layout.n_cols, mp.grid_cap),
                            prefixes=_staged_prefixes(region, layout, mp, tuning))
    except Unplannable as e:
        return _refused(original, e)
    busy_sms = min(target.sm_count, mp.grid)
    est = _estimate(kernel, original, target)
    gain = min_gain(tuning)
    idle = None
    if est.speedup < gain and cost.SM_OVERDRIVE * busy_sms < target.sm_count:
        idle = (f"only {busy_sms} of {target.sm_count} SMs would have work ({mp.n_rows} rows, "
                f"{mp.rows_per_block} per block{', ' + str(mp.splits) + ' blocks per row' if mp.splits > 1 else ''}): "
                f"estimated {est.us:.1f} us stitched vs {est.xla_us:.1f} us in XLA")
    return _declined_or_not(original, kernel, est, _decline_reason(region, est, gain, idle, tuning))


def _refused(region: Region, e: Unplannable) -> RegionPlan:
    """A region no kernel holds: left to XLA with the planner's reason, the op it names and its kind."""
    return RegionPlan(region=region, kernel=None, estimate=None, reason=str(e), reason_op=e.op_index,
                      reason_kind=e.kind)


def _declined_or_not(region: Region, kernel, est: cost.Estimate, reason: str | None) -> RegionPlan:
    """A planned region's plan: refused where the kernel templates have no form for one of its ops
    (`unrenderable`, asked first, so that no plan with such a kernel exists to be forced), else
    stitched or left to XLA by the cost model (`reason`)."""
    missing = unrenderable(kernel)
    if missing is not None:
        return _refused(region, missing)
    return RegionPlan(region=region, kernel=kernel, estimate=est, reason=reason,
                      reason_kind=None if reason is None else ReasonKind.COST)


def unrenderable(kernel) -> Unplannable | None:
    """What in a planned kernel the templates cannot render, or None: a row kernel's grid-wide
    reduction accumulates in float (its workspace and atomics), a tile kernel reduces with a sum, a
    max or a min. Asked of every planned kernel, before the cost model's decision."""
    if isinstance(kernel, KernelPlan):
        for op in kernel.region.ops:
            if opdefs.is_grid_reduction(op) and op.outputs[0].dtype not in ir.FLOAT_DTYPES:
                return Unplannable(ReasonKind.DTYPE, f"{op.prim} over the grid of a {op.outputs[0].dtype} value", op=op)
    if isinstance(kernel, tile.TilePlan):
        for op in kernel.region.ops:
            if op.prim in opdefs.REDUCTIONS and op.prim not in tile.TILE_REDUCTIONS:
                return Unplannable(ReasonKind.OP, f"{op.prim} in a tile", op=op)
    return None


def _staged_prefixes(region: Region, layout, mp, tuning) -> tuple[Prefix, ...]:
    """The prefixes of row inputs the kernel copies into its stage buffers (the copies skip what
    lies past a row's prefix; other loads read everything)."""
    if not tuning.prefixes or not mp.stages or not mp.smem_bytes:
        return ()
    return find_prefixes(region, layout)


def _skipped_bytes(kernel: KernelPlan) -> int:
    """What the stage copies leave unread past the rows' prefixes (their stashed chunks' share)."""
    mp, share = kernel.mapping, kernel.mapping.stashed_chunks / max(1, kernel.mapping.chunks)
    sizes = {v.id: v.nbytes for v in kernel.region.inputs}
    return int(sum(sizes[p.value] * (1 - p.kept(mp.n_cols)) * share for p in kernel.prefixes))


def column_group(n_cols: int, grid: int) -> int:
    """Columns a block finishes together after a grid barrier: the fewest (a power of two, at most a
    warp's 32) that give every column group a block of its own, so that all blocks share the sums of
    the blocks' partials. Each thread then sums few partials: with 8 columns a group, a 768-column
    reduction over 396 blocks left 300 blocks idle and each thread of the other 96 summing 12 or 13
    partials one after another."""
    group = 1
    while group < 32 and -(-n_cols // group) > grid:
        group *= 2
    return group


def _choose(region: Region, layout: Layout, passes: int, target: Target, tuning: mapping_mod.Tuning,
            pair: int = 0) -> Mapping:
    row_inputs = [v for v in region.inputs if layout.of(v).storage == FULL]
    row_reductions = [op for op in region.ops if opdefs.is_row_reduction(op)]
    # (a scan's carry runs through the row in order: its slices are not split over blocks)
    scans = [op for op in region.ops if op.prim in opdefs.SCANS]
    return mapping_mod.choose(layout, list(region.inputs) + list(region.outputs),
                              _live_arrays(region, layout), any(opdefs.is_grid_reduction(op) for op in region.ops),
                              target, tuning, stash_itemsizes=tuple(v.itemsize for v in row_inputs),
                              splittable=not any(op.prim in opdefs.PICKING for op in row_reductions) and not scans,
                              one_pass=passes == 1, pair=pair)


def _paired_or_not(region: Region, layout: Layout, online, passes: int, target: Target,
                   tuning: mapping_mod.Tuning) -> tuple[Region, Layout, Mapping, str | None]:
    """The region with a rotary embedding's other halves read from registers (plan/pairs.py) and
    its paired mapping, where one exists; else the region and layout as they are, their mapping,
    and why a pairing found was not taken. (Scans run along a row in column order, which a paired
    mapping does not keep.)"""
    paired, why = None, None
    if tuning.pairs and not any(op.prim in opdefs.SCANS for op in region.ops):
        paired = pairs.pair(region, layout)
    if paired is not None:
        try:
            layout2 = place(paired[0], sum_ids(online))
            return paired[0], layout2, _choose(paired[0], layout2, passes, target, tuning, pair=paired[1]), None
        except Unplannable as e:
            why = f"halves of {paired[1]} paired: {e}"
    return region, layout, _choose(region, layout, passes, target, tuning), why


def _estimate(kernel: KernelPlan, original: Region, target: Target) -> cost.Estimate:
    region, layout, mp = kernel.region, kernel.layout, kernel.mapping
    scans = [op for op in region.ops if op.prim in opdefs.SCANS]
    split_rounds = -(-mp.n_rows * mp.splits // mp.grid) if mp.splits > 1 else 0
    # (a paired kernel reads each half's other half from registers: what gathers it keeps are a
    # vector load of a column's own cos or sin, and the region's bytes bound it, measured at 86-91%
    # of the roofline in the RMS norm + rotary forward and the float32 fwd+bwd on an H200)
    full_gathers = any(op.prim == GATHER and layout.of(op.outputs[0]).storage == FULL for op in region.ops)
    return cost.estimate(layout, [v for v in region.inputs if layout.of(v).storage != MEMORY], region.outputs,
                         len(kernel.grid_reductions), kernel.workspace_bytes, target,
                         gathered_bytes=_gathered_bytes(region, layout), rereads=mp.stash == mapping_mod.GLOBAL,
                         busy_sms=min(target.sm_count, mp.grid), split_rounds=split_rounds,
                         n_scans=len(scans), views_after_reduction=_views_after_reduction(original),
                         gather_compute_ops=_computing_ops(region) if full_gathers and not mp.pair else 0,
                         xla_row_levels=kernel.xla_levels,
                         passes=kernel.passes, integer_ops=_integer_ops(region, layout),
                         xla_unfused=kernel.xla_unfused, xla_slow=cost.xla_slow_ns(region.ops, layout, target),
                         xla_copied=sum(op.outputs[0].nbytes for op in original.ops
                                        if op.param("for_products")),
                         skipped_bytes=_skipped_bytes(kernel))


def _fewer_passes(region: Region, online, layout: Layout, tuning: mapping_mod.Tuning):
    """(region, online sums, layout, shifts taken out, passes over the rows): with the row
    reductions' shifts taken out (plan/shifts.py) where that saves a pass, as planned otherwise."""
    passes = cost.chunk_passes(layout, region.ops, region.outputs, online)
    shifted, n = pull_out(region, layout, factors=bool(tuning.factors)) if tuning.shifts else (region, 0)
    if not n:
        return region, online, layout, 0, passes
    online2 = find_online_sums(shifted.ops) if tuning.online else ()
    try:
        layout2 = place(shifted, sum_ids(online2))
    except Unplannable:
        return region, online, layout, 0, passes
    passes2 = cost.chunk_passes(layout2, shifted.ops, shifted.outputs, online2)
    if passes2 >= passes:
        return region, online, layout, 0, passes
    return shifted, online2, layout2, n, passes2


def estimate_rows(plan: RegionPlan, n_rows: int, target: Target, registers: int | None = None) -> cost.Estimate:
    """The cost model's estimate of `plan`'s kernel run over `n_rows` rows (its grid following them,
    as a shape family's launch does): which of a family's kernels suits a row count (families.py).
    `registers` (a thread's, as compiled) bounds a cooperative grid to the blocks resident at once."""
    kernel = plan.kernel
    mp = kernel.mapping
    grid = max(1, min(-(-n_rows * mp.splits // mp.rows_per_block), mp.grid_cap))
    if mp.cooperative and registers:
        grid = target.resident_grid(grid, mp.block, registers)
    kernel = dataclasses.replace(kernel, layout=dataclasses.replace(kernel.layout, n_rows=n_rows),
                                 mapping=dataclasses.replace(mp, n_rows=n_rows, grid=grid))
    return _estimate(kernel, plan.region, target)


def _views_after_reduction(region: Region) -> bool:
    """Whether a data-moving op (ops.VIEWS) reads, through any ops, a row reduction's result: XLA
    then runs what follows the reduction as a kernel of its own (cost.estimate)."""
    reduced: set[int] = set()
    for op in region.ops:
        ids = {a.id for a in op.inputs if isinstance(a, ir.Value)}
        if op.prim in opdefs.VIEWS and ids & reduced:
            return True
        if opdefs.is_row_reduction(op) or ids & reduced:
            reduced.update(o.id for o in op.outputs)
    return False


# What XLA saves by fusing across a cut is writing and reading the values that cross it: where the
# region's results are this small a part of its traffic, the cut costs next to nothing (a language
# model's per-token log-probability over a 30k vocabulary, then a per-sequence mean: results of 4
# bytes a row of 122 KB, 6.5e-5 of the traffic; stitched 2.3x on an H200), unlike a softmax whose
# full-size result XLA fuses into the next op (DIEN's attention). At 5% BERT's train step also
# stitched 12 small column sums (results 1e-3 of their traffic, inputs XLA fuses from their
# producers) and went from 1.20x to 1.17x: the cut's other side matters too, which this does not see.
CUT_RESULT_FRACTION = 2e-4
# A region cut from a neighbour is stitched only where the estimates say it saves this much (µs).
# What XLA fuses across the cut is unseen here, so this is set from measured cases: DIEN's softmax
# over 50 steps (estimated 13.6 -> 6.6 us) lost 11% stitched alone; BERT's attention softmax
# forward (estimated 64.8 -> 30.8 us a layer at 128 tokens, 242.8 -> 115.1 at 512) took its step
# from 19.56 to 19.33 ms at 128 tokens and from 25.07 to 24.21 at 512 (float32, H100).
CUT_MIN_SAVING_US = 20.0
# A region this small moves its bytes in about a microsecond: both sides are launches, and XLA fuses
# small shapes more than the cost model assumes. Measured on an H200 (jax 0.11.2, GPU time): a layer
# norm backward over 2 x 128 and DIEN's attention over 256 x 50 x 36, each one XLA kernel of
# 1.2-2.7 us, ran 1.4-3.5 us stitched (0.78-0.86x). Stitched only where XLA is estimated to need
# LAUNCH_BOUND_MIN_KERNELS kernels or more, which even our slowest such kernel beats.
LAUNCH_BOUND_BYTES = 4 << 20
LAUNCH_BOUND_MIN_KERNELS = 4


def _cut_matters(region: Region, est: cost.Estimate) -> bool:
    out_bytes = sum(v.size * v.itemsize for v in region.outputs)
    return 2 * out_bytes >= CUT_RESULT_FRACTION * est.bytes


def _decline_reason(region: Region, est: cost.Estimate, min_gain: float, idle: str | None,
                    tuning: mapping_mod.Tuning) -> str | None:
    """Why the cost model leaves a planned region to XLA, or None to stitch it. With a min_gain_pct
    in JAXSTITCH_TUNE the estimated speedup is the only test."""
    if tuning.min_gain_pct is not None:
        return None if est.speedup >= min_gain else (
            f"estimated {est.us:.1f} us stitched vs {est.xla_us:.1f} us in XLA: below the {min_gain}x "
            "asked for by JAXSTITCH_TUNE's min_gain_pct")
    reason = None
    # (XLA's one kernel moves the bytes ours would: only an issue-bound estimate can favour ours)
    if est.speedup < min_gain:
        if idle is not None:
            reason = idle
        elif est.xla_kernels == 1:
            reason = (f"XLA already runs this as one kernel (est. {est.xla_us:.1f} us vs {est.us:.1f} us "
                      "stitched): " + ("nothing to gain" if est.speedup < 1.05 else
                                       f"a predicted {est.speedup:.2f}x is below the {min_gain}x asked for"))
        elif est.speedup < 1:
            reason = f"estimated {est.us:.1f} us stitched vs {est.xla_us:.1f} us in XLA: stitching would be slower"
        else:
            reason = (f"estimated {est.us:.1f} us stitched vs {est.xla_us:.1f} us in XLA: a predicted "
                      f"{est.speedup:.2f}x is below the {min_gain}x the cost model asks for (its error)")
    if reason is None and est.bytes < LAUNCH_BOUND_BYTES and est.xla_kernels < LAUNCH_BOUND_MIN_KERNELS:
        reason = (f"launch-bound: {est.bytes / 1e6:.2f} MB move in about a microsecond, where XLA's "
                  f"{est.xla_kernels} kernel{'s' if est.xla_kernels > 1 else ''} measured as fast as one of ours")
    need = CUT_MIN_SAVING_US if tuning.cut_saving_us is None else tuning.cut_saving_us
    if reason is None and region.cut and _cut_matters(region, est) and est.xla_us - est.us < need:
        reason = (f"cut from a neighbouring region that cannot be planned with it (estimated {est.us:.1f} us "
                  f"stitched vs {est.xla_us:.1f} us in XLA): a saving under {need:g} us, which XLA's fusing "
                  "across the cut may take back (DIEN's attention softmax, stitched alone: 0.89x on an H200)")
    return reason


def _plan_tile(region: Region, target: Target, tuning: mapping_mod.Tuning, relaxed: bool,
               row_error: Unplannable) -> RegionPlan:
    """A region rows cannot hold (`row_error` says why), planned as a batch of small tiles
    (plan/tile.py)."""
    try:
        kernel = tile.plan_tile(region, target, tuning, bool(tuning.fast_exp) and fast_exp(region))
    except Unplannable as e:  # (the kind of the last plan tried: the tiles', where the region has a tile shape)
        if isinstance(e, tile.NotATile):
            why, kind = str(row_error), row_error.kind
        else:
            why, kind = f"{row_error}; as a batch of tiles: {e}", e.kind
        return RegionPlan(region=region, kernel=None, estimate=None, reason=why, reason_op=row_error.op_index,
                          reason_kind=kind)
    if relaxed:
        kernel = dataclasses.replace(kernel, mapping=dataclasses.replace(kernel.mapping, min_blocks=1))
    est = tile.estimate(kernel, target)
    return _declined_or_not(region, kernel, est, _decline_reason(region, est, min_gain(tuning), None, tuning))


def min_gain(tuning: mapping_mod.Tuning) -> float:
    """The estimated speedup the cost model asks for (JAXSTITCH_TUNE's min_gain_pct overrides it)."""
    return cost.MIN_GAIN if tuning.min_gain_pct is None else tuning.min_gain_pct / 100
