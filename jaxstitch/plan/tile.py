"""The tile scheme: batches of small matrices, reduced along both of their axes in one kernel.

A row-space kernel (layout.py) needs every row reduction over the same columns. DIEN's attention
over a user's behaviour sequence works on a [B, A, K] batch (A = 50 steps, K = 36 features) and
reduces over K (scores), then over A (softmax, the weighted sum of the steps), and its backward pass
does both again: XLA runs it as several small kernels at 9-16% of the HBM roofline. Here each block
takes one batch element, an A x K *tile*: inputs spanning the whole tile are copied to shared memory
once, values along one axis of the tile live in shared-memory arrays, and each reduction is a loop of
the block's threads over the tile, ordered so that every sum is deterministic. Where a tile's shared
memory lets enough of them fit an SM, a warp takes each tile instead, four to a block (TILE_TEAMS).

Planning labels every dimension of every value with the tile axis it runs along ("n": the batch
rows, "a", "b": the tile's two axes), then schedules the ops into *epochs* separated by block
barriers: a value written to shared memory in one epoch is read in the next.

A transpose of the tile's two axes moves no data here: the tile is held by its axes, so a transposed
value is another name for its operand, and only its memory order differs (a value's `order`, e.g.
"nba": its dimensions run along n, b, a). An input in that order is copied into shared memory as it
lies and read there transposed; an output in that order is stored by a loop walking a fastest.
"""
from __future__ import annotations

import dataclasses
import math

from ..core import ir
from ..core import ops as opdefs
from ..core.config import Tuning
from ..core.targets import Target
from ..graph.partition import Region
from .cost import XLA_EFFICIENCY, Estimate
from .layout import ReasonKind, Unplannable
from .mapping import SMEM_PER_BLOCK_SYSTEM

N, A, B = "n", "a", "b"
FULL, ROW = "ab", ""  # domains: what a value varies over inside one batch element's tile

# Where a value is read from. STASH: an input of the tile's batch element, in shared memory (copied
# while the block works on the tile before: two stage buffers); GLOBAL: an input the same for every
# batch element, read in place (cached); INLINE: recomputed where it is used; ARRAY: a shared-memory
# array along one tile axis (materialized values and reduction results); REG: one register per
# thread (row scalars, the same in every thread).
STASH, GLOBAL, INLINE, ARRAY, REG = "stash", "global", "inline", "array", "reg"

# How a stashed input is copied ahead: VECTORS, at the tile's start each thread loads up to
# MAX_VECTORS_PER_THREAD 16-byte vectors of the next tile and stores them to the other stage buffer
# at once (its bytes a multiple of 16; its warps wait for the loads there, the SM's other blocks
# work meanwhile); ASYNC, cp.async in 16-byte pieces (larger such inputs); REGS, each thread loads a
# few elements into registers and stores them to shared memory at the tile's end; SYNC, copied when
# its tile starts (no overlap: large and unaligned). DIEN's float32 attention ([16384, 50, 36]), its
# keys copied as vectors rather than by cp.async: 110 -> 99 us on an H100 (kernel alone). Holding
# the vectors in registers to the tile's end instead (as REGS does) gained nothing: its loads stayed
# in flight across the tile's loops (109 us; 98 where ptxas happened to spill one and so waited for
# them at the start).
ASYNC, VECTORS, REGS, SYNC = "async", "vectors", "regs", "sync"
# A half-precision input copied through registers (REGS: a query or an output gradient along b) is
# stashed as float32, converted once a tile as it is stored rather than at every read: the loops
# over the whole tile read it once per element (DIEN's attention, bfloat16).
MAX_REGS_PER_THREAD = 4
MAX_VECTORS_PER_THREAD = 4

# Loops of one epoch. EACH walks the tile element by element (full-size
# outputs, whole-tile reductions); ALONG_B reduces over b for each a (groups of lanes per a);
# ALONG_A reduces over a for each b (lanes over b, warps over a, per-warp partials); MAP_A / MAP_B
# walk one axis (materialize values, finish ALONG_A partials, store outputs).
# ROW_STEP is straight-line code at row scope: row scalars, in every thread (first in its epoch).
# EACH_ALONG_A is a warp's EACH loop that only stores whole tiles and the ALONG_A loop of its epoch
# walked as one (see _each_along_a).
EACH, ALONG_B, ALONG_A, MAP_A, MAP_B = "each", "along_b", "along_a", "map_a", "map_b"
EACH_ALONG_A = "each_along_a"
ROW_STEP = "row"

class NotATile(Unplannable):
    """The region has no tile shape at all (as opposed to a tile plan that failed): the report
    then gives the row space's reason alone."""

    def __init__(self, detail: str):
        super().__init__(ReasonKind.TILE, detail)


NOT_A_TILE = "no batch of tiles"
# The reductions a tile kernel renders (lowering/cuda_ops.REDUCE: their functors and identities).
TILE_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min"})
MAX_TILE_SMEM = 64 * 1024
# Threads per block. DIEN's 50x36 tiles on an H100: 128 was 1.16x faster than 256 (more tiles in
# flight); 64 was 1.20x faster in bfloat16 but 0.92x in float32.
TILE_BLOCK = 128
# Tiles a block works on at once, each by one warp (1: the whole block on one tile): a warp's tile
# ends its epochs at the warp's barrier, where the block's waits at a block barrier with idle warps
# (epochs of one warp, loops over 36 columns). DIEN's 50x36 tiles on an H100, GPU time:
# bfloat16 63.7 -> 54.0 us (20 warps an SM); float32 94.3 -> 102.6 (its tiles' shared memory leaves
# 12 warps an SM), so a warp takes a tile only where MIN_TEAM_WARPS of them fit an SM.
TILE_TEAMS = 4
MIN_TEAM_WARPS = 16
# Fraction of copy bandwidth a tile kernel reaches: DIEN attention fwd+bwd, [16384, 50, 36], H100:
# 70% float32, 37% bfloat16 (bound by instruction issue, not memory: both take ~110-117 us).
TILE_EFFICIENCY = 0.6
# XLA's kernels that reduce small tiles along their first (middle) axis reach about a third of the
# bandwidth where the tile's b axis does not fill XLA's column-reduction tiles, XLA_COLUMN_TILE
# wide: DIEN's attention fwd+bwd (b = 36), 6 kernels, 378 us on an H100 (359 us on an H200) where
# this model's passes move 354 MB (31% of the H100's bandwidth). Where b is a multiple of it XLA
# runs them as well as row reductions (cost.XLA_EFFICIENCY): an attention pooling over 4096 x 100 x
# 64 (a softmax over the 100, then the weighted sum of the 100 rows of 64), one XLA kernel at 98% of
# the roofline (H200, jax 0.11.2). Passes without such a reduction are row reductions XLA runs well.
XLA_MIDDLE_AXIS_EFFICIENCY = 0.35
XLA_COLUMN_TILE = 32


@dataclasses.dataclass(frozen=True)
class TileValue:
    value: ir.Value
    kind: str            # the axes it spans, in tile order: "nab", "na", "b", "" ...
    home: str            # STASH, GLOBAL, INLINE, ARRAY or REG
    epoch: int           # first epoch it can be read inline / in registers (-1: never)
    array_epoch: int = -1  # first epoch its shared-memory array can be read (-1: none)
    offset: int = -1     # bytes into dynamic shared memory (stash or array); partials of reductions
    partial_offset: int = -1
    iota_axis: str = ""  # for iota values: the tile axis their dimension runs along
    copy: str = ""       # stashed inputs: VECTORS, ASYNC, REGS or SYNC
    wide: bool = False   # stashed as float32 (a half-precision REGS copy, see REGS)
    order: str = ""      # inputs: the axes in memory order when transposed ("nba"), else ""

    @property
    def domain(self) -> str:
        return self.kind.replace(N, "")


@dataclasses.dataclass(frozen=True)
class TileStep:
    """One loop (or a row-level statement group) of one epoch."""

    epoch: int
    loop: str                       # EACH, ALONG_B, ALONG_A, EACH_ALONG_A, MAP_A, MAP_B or ROW_STEP
    ops: tuple[ir.Op, ...] = ()     # ops computed here (reductions folded, values materialized)
    finish: tuple[ir.Op, ...] = ()  # ALONG_A reductions whose partials this MAP_B combines
    stores: tuple[ir.Value, ...] = ()  # region outputs stored here


@dataclasses.dataclass(frozen=True)
class TileMapping:
    """The launch shape (the names the launcher and report read, as Mapping has them)."""

    n_rows: int
    tile_a: int
    tile_b: int
    block: int
    grid: int
    smem_bytes: int
    min_blocks: int
    group: int                # lanes per a in ALONG_B loops (see lanes_per_a)
    stage_bytes: int = 0      # one stage buffer of stashed inputs (two of them lead the shared memory)
    cooperative: bool = False
    stages: int = 2
    pairs: bool = False       # loops along b take two consecutive b a step (see takes_pairs)
    slices: int = 1           # threads per b (or pair of b) in ALONG_A loops (see slices)
    teams: int = 1            # tiles a block works on at once, one a warp when more than 1 (see teams)

    @property
    def n_cols(self) -> int:
        return self.tile_a * self.tile_b

    @property
    def team(self) -> int:
        """Threads working on one tile."""
        return self.block // self.teams

    @property
    def team_smem(self) -> int:
        """Shared memory of one tile's threads (the block's is TEAMS of these, one after another)."""
        return self.smem_bytes // self.teams

    @property
    def name(self) -> str:
        if self.teams > 1:
            return f"warp per {self.tile_a}x{self.tile_b} tile, {self.teams} a block"
        return f"block per {self.tile_a}x{self.tile_b} tile, {self.block} threads"


@dataclasses.dataclass(frozen=True)
class TilePlan:
    region: Region
    values: tuple[TileValue, ...]
    steps: tuple[TileStep, ...]
    mapping: TileMapping
    alias: tuple[tuple[int, int], ...]   # layout op outputs -> the value they name
    epochs: int
    out_kinds: tuple[tuple[int, str], ...] = ()  # each region output's axes in memory order (outputs may be aliases)
    merged_store: bool = False  # an output holds the tile's two axes merged into one (see estimate)
    workspace_bytes: int = 0
    fast_exp: bool = False
    scheme: str = "regional"
    one_warp: tuple[int, ...] = ()  # epochs the block's first warp runs alone (see _one_warp_epochs)
    declined: str = ""  # the mapping planned first and why it lost (a warp on each tile; see plan_tile)

    def __post_init__(self):
        object.__setattr__(self, "_by_id", {t.value.id: t for t in self.values})
        object.__setattr__(self, "_alias", dict(self.alias))

    def out_kind(self, v: ir.Value) -> str:
        return dict(self.out_kinds)[v.id]

    def of(self, v: ir.Value) -> TileValue:
        return self._by_id[self.root(v.id)] if self.root(v.id) in self._by_id else self._by_id[v.id]

    def root(self, vid: int) -> int:
        while vid in self._alias:
            vid = self._alias[vid]
        return vid

    @property
    def description(self) -> str:
        return self.mapping.name + f", {self.epochs + 1} epochs" + (", fast exp" if self.fast_exp else "")


# ---- labelling -------------------------------------------------------------------------------------

def _tile_shape(region: Region) -> tuple[int, ...]:
    """The largest value's non-unit shape (of those as large, one with the most axes: a tile merged
    into one axis is not the tile)."""
    big = max([o for op in region.ops for o in op.outputs] + list(region.inputs),
              key=lambda v: (v.size, sum(d != 1 for d in v.shape)))
    shape = tuple(d for d in big.shape if d != 1)
    if len(shape) < 3:
        raise NotATile(f"{NOT_A_TILE}: the largest value {big.shape} has fewer than 3 axes")
    return shape


def label(region: Region) -> tuple[tuple[int, ...], dict[int, str], dict[int, list], dict[int, str]]:
    """The tile shape (batch dims..., A, B), each value's kind ("nab", "na", "b", ...), each of its
    dimensions' label ("n0".., "a", "b", or "1" for a unit dimension), and its axes in memory order
    ("nba" for a transposed tile, else its kind)."""
    shape = _tile_shape(region)
    names = [f"n{i}" for i in range(len(shape) - 2)] + [A, B]
    values = {v.id: v for v in region.inputs}
    values.update({o.id: o for op in region.ops for o in op.outputs})
    transposed = {op.outputs[0].id for op in region.ops if op.prim == "transpose"}
    labels = _first_labels(values, shape, names, transposed)
    _propagate_labels(region, labels, transposed)
    _label_by_size(labels, values, names, shape)
    kinds, orders = _kinds_and_orders(labels, values, names)
    return shape, kinds, labels, orders


def _first_labels(values: dict[int, ir.Value], shape: tuple[int, ...], names: list[str], transposed: set[int]
                  ) -> dict[int, list]:
    """The labels propagation starts from: a value of the tile's own shape (not a transpose's result)
    runs along the tile's axes in order; every other value has only its unit dimensions labelled."""
    labels: dict[int, list] = {}
    for v in values.values():
        labels[v.id] = [("1" if d == 1 else None) for d in v.shape]
        if tuple(d for d in v.shape if d != 1) == shape and v.id not in transposed:
            it = iter(names)
            labels[v.id] = ["1" if d == 1 else next(it) for d in v.shape]
    return labels


def _propagate_labels(region: Region, labels: dict[int, list], transposed: set[int]) -> None:
    """Carries labels across the region's ops (both ways: operands to results and back) until none
    changes, raising where two tile axes meet."""
    def unify(x, i, y, j) -> bool:
        lx, ly = labels[x.id][i], labels[y.id][j]
        if lx == ly:
            return False
        if lx is not None and ly is not None:
            raise Unplannable(ReasonKind.LAYOUT,
                              f"an axis of {x.shape} meets an axis of {y.shape} along different tile axes")
        if lx is None:
            labels[x.id][i] = ly
        else:
            labels[y.id][j] = lx
        return True

    for _ in range(2 * len(region.ops) + 2):
        changed = False
        for op in region.ops:
            changed |= _tie_axes(op, labels, unify, transposed)
        if not changed:
            break


def _tie_axes(op: ir.Op, labels: dict[int, list], unify, transposed: set[int]) -> bool:
    """One op's ties between its operands' dimensions and its result's (one pass of
    _propagate_labels); whether a label changed."""
    changed = False
    out = op.outputs[0]
    ins = [a for a in op.inputs if isinstance(a, ir.Value)]
    if op.prim in opdefs.ELEMENTWISE:
        for a in ins:
            if len(a.shape) == len(out.shape):
                for i, (da, do) in enumerate(zip(a.shape, out.shape)):
                    if da == do != 1:
                        changed |= unify(a, i, out, i)
            elif a.shape:
                raise Unplannable(ReasonKind.LAYOUT, f"{op.prim} of operands of different ranks")
    elif op.prim == "transpose":  # output dimension j is operand dimension perm[j]
        for j, i in enumerate(op.param("permutation")):
            if ins[0].shape[i] != 1:
                changed |= unify(ins[0], i, out, j)
    elif op.prim == "broadcast_in_dim" and ins:
        for i, d in enumerate(op.param("broadcast_dimensions")):
            if ins[0].shape[i] != 1:
                changed |= unify(ins[0], i, out, d)
    elif opdefs.is_layout(op) and ins:
        src = [i for i, d in enumerate(ins[0].shape) if d != 1]
        dst = [i for i, d in enumerate(out.shape) if d != 1]
        if [ins[0].shape[i] for i in src] == [out.shape[i] for i in dst]:
            for i, j in zip(src, dst):
                changed |= unify(ins[0], i, out, j)
        elif transposed:  # a reshape merging or splitting a transposed tile's two axes
            changed |= _merge_or_split(ins[0], src, out, dst, labels, unify)
        else:  # (rows split into tiles alone: a row chain XLA runs well, measured 0.93x as tiles)
            raise Unplannable(ReasonKind.LAYOUT, f"{op.prim} {ins[0].shape} -> {out.shape} moves data across tile axes")
    elif op.prim in opdefs.REDUCTIONS:
        axes = set(op.param("axes"))
        kept = [i for i in range(len(ins[0].shape)) if i not in axes]
        for j, i in enumerate(kept):
            changed |= unify(ins[0], i, out, j)
    return changed


def _label_by_size(labels: dict[int, list], values: dict[int, ir.Value], names: list[str],
                   shape: tuple[int, ...]) -> None:
    """Labels what propagation left unlabelled where only one tile axis has its size."""
    sizes = dict(zip(names, shape))
    for vid, ls in labels.items():  # an axis no op ties to the tile (a broadcast not yet used): by size
        for i, x in enumerate(ls):
            if x is None:
                fit = [name for name in names if sizes[name] == values[vid].shape[i]]
                if len(fit) == 1:
                    ls[i] = fit[0]


def _kinds_and_orders(labels: dict[int, list], values: dict[int, ir.Value], names: list[str]
                      ) -> tuple[dict[int, str], dict[int, str]]:
    """Each value's kind and memory order from its final labels, raising for values the tile
    scheme cannot hold (an unlabelled axis, batch axes transposed or only partly spanned)."""
    kinds, orders = {}, {}
    order = {name: i for i, name in enumerate(names)}
    for vid, ls in labels.items():
        real = [x for x in ls if x != "1"]
        if None in real:
            raise Unplannable(ReasonKind.LAYOUT, f"a value of shape {values[vid].shape} has an axis of no tile axis")
        real = [y for x in real for y in ([x] if x.startswith("n") else list(x))]  # merged "ba": b, a
        batch = [x for x in real if x.startswith("n")]
        tile_axes = [x for x in real if not x.startswith("n")]
        if len(set(real)) != len(real) or real[:len(batch)] != sorted(batch, key=order.get):
            raise Unplannable(ReasonKind.LAYOUT,
                              f"a value of shape {values[vid].shape} is transposed against the tile's batch axes")
        if batch and len(batch) != len(names) - 2:
            raise Unplannable(ReasonKind.LAYOUT, f"a value of shape {values[vid].shape} spans part of the batch axes")
        kinds[vid] = (N if batch else "") + "".join(sorted(tile_axes))
        orders[vid] = (N if batch else "") + "".join(tile_axes)
    return kinds, orders


def _merge_or_split(x: ir.Value, src: list[int], y: ir.Value, dst: list[int], labels, unify) -> bool:
    """A reshape between a value with the tile's two axes apart (sizes A and B, in either order, last)
    and one with them merged into one axis of A*B elements, batch axes unchanged: the merged axis is
    labelled with both in memory order ("ba": b runs slower), or the two apart from the merged one.
    Returns whether a label changed."""
    if len(src) == len(dst) + 1:
        apart, a_dims, merged, m_dims = x, src, y, dst
    elif len(dst) == len(src) + 1:
        apart, a_dims, merged, m_dims = y, dst, x, src
    else:
        raise Unplannable(ReasonKind.LAYOUT, f"reshape {x.shape} -> {y.shape} moves data across tile axes")
    a_sizes = [apart.shape[i] for i in a_dims]
    m_sizes = [merged.shape[i] for i in m_dims]
    if a_sizes[:-2] != m_sizes[:-1] or a_sizes[-2] * a_sizes[-1] != m_sizes[-1]:
        raise Unplannable(ReasonKind.LAYOUT, f"reshape {x.shape} -> {y.shape} moves data across tile axes")
    changed = False
    for i, j in zip(a_dims[:-2], m_dims[:-1]):
        changed |= unify(apart, i, merged, j)
    i, j, k = a_dims[-2], a_dims[-1], m_dims[-1]
    li, lj, lk = labels[apart.id][i], labels[apart.id][j], labels[merged.id][k]
    if li in (A, B) and lj in (A, B) and li != lj:
        changed |= _set(labels, merged, k, li + lj)
    elif lk in (A + B, B + A):
        changed |= _set(labels, apart, i, lk[0]) | _set(labels, apart, j, lk[1])
    return changed


def _set(labels, v: ir.Value, i: int, name: str) -> bool:
    """Labels axis i of v `name`; whether that changed it."""
    if labels[v.id][i] == name:
        return False
    if labels[v.id][i] is not None:
        raise Unplannable(ReasonKind.LAYOUT, f"an axis of {v.shape} meets the tile's axes in two orders")
    labels[v.id][i] = name
    return True


def _iota_axis(op: ir.Op, labels: dict[int, list]) -> str:
    if op.prim != "iota":
        return ""
    axis = labels[op.outputs[0].id][op.param("dimension")]
    if axis not in (A, B):
        raise Unplannable(ReasonKind.LAYOUT, "iota along the batch axes in a tile")
    return axis


# ---- scheduling --------------------------------------------------------------------------------------

def _reduced_axes(op: ir.Op, kinds: dict[int, str]) -> str:
    src, out = kinds[op.inputs[0].id], kinds[op.outputs[0].id]
    return "".join(x for x in src if x not in out)


def plan_tile(region: Region, target: Target, tuning: Tuning = Tuning(), fast_exp: bool = False) -> TilePlan:
    """The tile plan, a warp on each tile where the SM holds MIN_TEAM_WARPS such warps (shared memory
    allowing), else the block (see TILE_TEAMS); a tuning's `teams` decides alone."""
    if tuning.teams is not None:
        return _plan_tile(region, target, tuning, fast_exp)
    plan = _plan_tile(region, target, dataclasses.replace(tuning, teams=TILE_TEAMS), fast_exp)
    m = plan.mapping
    per_sm = _resident_blocks(m.block, m.smem_bytes, target)
    if m.teams == 1 or per_sm * m.teams >= MIN_TEAM_WARPS:
        return plan
    why = (f"{m.name} ({m.team_smem} bytes of shared memory a tile): {per_sm * m.teams} warps an SM, "
           f"fewer than {MIN_TEAM_WARPS}")
    return dataclasses.replace(_plan_tile(region, target, dataclasses.replace(tuning, teams=1), fast_exp),
                               declined=why)


def _plan_tile(region: Region, target: Target, tuning: Tuning, fast_exp: bool) -> TilePlan:
    moving = opdefs.VIEWS | opdefs.SCANS
    moves = sorted({op.prim for op in region.ops if op.prim in moving} - {"transpose"})
    if moves:
        raise Unplannable(ReasonKind.OP,
                          f"{', '.join(moves)} in a tile (data-moving ops other than transposes, and scans, "
                          "are planned in row spaces only)")
    schedule = _TileSchedule(region, tuning, *label(region))
    schedule.stage_inputs()
    for op in schedule.compute:
        if op.prim in opdefs.REDUCTIONS:
            schedule.schedule_reduction(op)
        else:
            schedule.schedule_elementwise(op)
    schedule.schedule_stores()
    return schedule.plan(target, fast_exp)


class _TileSchedule:
    """The state _plan_tile fills in, one phase a method: each value's home and epochs (`tv`), the
    steps of each epoch, and the shared memory laid out so far."""

    def __init__(self, region: Region, tuning: Tuning, shape: tuple[int, ...], kinds: dict[int, str],
                 labels: dict[int, list], orders: dict[int, str]):
        self.region, self.tuning = region, tuning
        self.kinds, self.labels, self.orders = kinds, labels, orders
        self.n_rows, self.ta, self.tb = math.prod(shape[:-2]), shape[-2], shape[-1]
        self.alias = {}
        for op in region.ops:
            if _names_its_operand(op):
                self.alias[op.outputs[0].id] = op.inputs[0].id
        self.compute = [op for op in region.ops if not opdefs.is_layout(op) and op.prim != "transpose"]
        self._check_reductions()
        self.outputs = {v.id for v in region.outputs}
        self.full_readers = self._full_readers()
        self.teams = tuning.teams or 1
        self.block = 32 if self.teams > 1 else _block(tuning)  # threads a tile (a team)
        self.stage = 0
        self.smem = 0
        self.tv: dict[int, TileValue] = {}
        self.steps: dict[tuple[int, str], dict] = {}
        self.partials = []  # reductions finished from per-warp partials (their slots are laid out last)
        # Values along a or b that take a few instructions from inputs and registers: recomputed where
        # used, even in tile-wide loops, rather than materialized (a shared array costs a barrier).
        self.cheap: set[int] = set()

    def root(self, vid: int) -> int:
        """The value a layout op's or a transpose's result names (itself for any other)."""
        while vid in self.alias:
            vid = self.alias[vid]
        return vid

    def dom(self, vid: int) -> str:
        """The value's domain: the tile axes it varies over inside one batch element."""
        return self.kinds[vid].replace(N, "")

    def _check_reductions(self) -> None:
        """Raises for reductions a tile cannot run: picking ones, and those over the batch axes."""
        for op in self.compute:
            if op.prim in opdefs.REDUCTIONS:
                if op.prim in opdefs.PICKING:
                    raise Unplannable(ReasonKind.OP, f"{op.prim} in a tile")
                if N in _reduced_axes(op, self.kinds):
                    raise Unplannable(ReasonKind.LAYOUT,
                                      f"{op.prim} over the batch axes (a column reduction) in a tile")

    def _full_readers(self) -> set[int]:
        """Which values a full-tile consumer reads: materialized along their axis when not full themselves."""
        full_readers: set[int] = set()
        for op in self.compute:
            d = self.dom(op.inputs[0].id) if op.prim in opdefs.REDUCTIONS else self.dom(op.outputs[0].id)
            if d == FULL:
                full_readers.update(self.root(a.id) for a in op.inputs if isinstance(a, ir.Value))
        for v in self.region.outputs:
            if self.dom(v.id) == FULL:
                full_readers.add(self.root(v.id))
        return full_readers

    def stage_inputs(self) -> None:
        """Homes the inputs: each batch element's own in the stage buffers (copied ahead as `copy`
        says), those the same for every batch element read in place."""
        block = self.block
        for v in self.region.inputs:
            if N in self.kinds[v.id]:
                count = v.size // self.n_rows
                size = count * v.itemsize
                copy = (VECTORS if size % 16 == 0 and size // 16 <= MAX_VECTORS_PER_THREAD * block else
                        ASYNC if size % 16 == 0 else
                        REGS if count <= MAX_REGS_PER_THREAD * block else SYNC)
                wide = copy == REGS and v.dtype in ir.HALF_DTYPES
                self.tv[v.id] = TileValue(v, self.kinds[v.id], STASH, 0, 0, self.stage, copy=copy,
                                          order=_transposed(self.orders[v.id]), wide=wide)
                self.stage += _pad(4 * count if wide else size)
            else:
                self.tv[v.id] = TileValue(v, self.kinds[v.id], GLOBAL, 0, order=_transposed(self.orders[v.id]))
        self.smem = 2 * self.stage

    def _need(self, a, consumer_domain: str) -> int:
        """The first epoch in which an op over `consumer_domain` can read `a`."""
        t = self.tv.get(self.root(a.id))
        if t is None:  # a broadcast literal
            return 0
        if consumer_domain == FULL and t.domain != FULL and t.array_epoch >= 0:
            return t.array_epoch
        if t.home == STASH:
            return 0
        if t.home == ARRAY and t.epoch < 0:
            return t.array_epoch
        return t.epoch

    def _finished_in(self, a) -> int:
        """`need` for an op of the MAP_B loop that combines ALONG_A partials: their sum is a local
        there, one epoch before its array can be read."""
        t = self.tv.get(self.root(a.id))
        if t is not None and t.home == ARRAY and t.epoch < 0 and t.value.id in self.partials:
            return t.array_epoch - 1
        return self._need(a, B)

    def _ready(self, op: ir.Op, consumer_domain: str) -> int:
        """The first epoch in which all of the op's operands can be read by a loop over `consumer_domain`."""
        return max([self._need(a, consumer_domain) for a in op.inputs if isinstance(a, ir.Value)] + [0])

    def _step(self, epoch: int, loop: str) -> dict:
        """The ops, finished reductions and stores of one loop of one epoch, created on first use."""
        return self.steps.setdefault((epoch, loop), {"ops": [], "finish": [], "stores": []})

    def schedule_elementwise(self, op: ir.Op) -> None:
        """Places an op that reduces nothing (elementwise, broadcast, iota ...): in a register, inline
        where it is read, or materialized in a shared array along its axis."""
        out = op.outputs[0]
        e = self._ready(op, self.dom(out.id))
        d = self.dom(out.id)
        axis = _iota_axis(op, self.labels)
        srcs = [self.tv.get(self.root(a.id)) for a in op.inputs if isinstance(a, ir.Value)]
        if op.prim not in opdefs.EXPENSIVE and all(
                t is None or t.home in (STASH, GLOBAL, REG) or t.value.id in self.cheap for t in srcs):
            self.cheap.add(out.id)
        if d in (A, B) and (out.id in self.outputs or out.id in self.full_readers and out.id not in self.cheap):
            if d == B:  # in the MAP_B loop that combines a reduction's partials, after it
                e = max([self._finished_in(a) for a in op.inputs if isinstance(a, ir.Value)] + [0])
            self.tv[out.id] = TileValue(out, self.kinds[out.id], ARRAY, e, e + 1, self.smem, iota_axis=axis)
            self.smem += _pad(4 * (self.ta if d == A else self.tb))
            self._step(e, MAP_A if d == A else MAP_B)["ops"].append(op)
        elif d == ROW:
            self.tv[out.id] = TileValue(out, self.kinds[out.id], REG, e, iota_axis=axis)
            self._step(e, ROW_STEP)["ops"].append(op)
        else:
            self.tv[out.id] = TileValue(out, self.kinds[out.id], INLINE, e, iota_axis=axis)

    def schedule_reduction(self, op: ir.Op) -> None:
        """Places a reduction in the loop that walks the axes it reduces, its result in a shared
        array or a register (partials of each warp first where it spans warps)."""
        out = op.outputs[0]
        e = self._ready(op, self.dom(op.inputs[0].id))
        d = self.dom(out.id)
        reduced = _reduced_axes(op, self.kinds)
        src = self.dom(op.inputs[0].id)
        if src == FULL and d == A:          # over b, for each a
            self.tv[out.id] = TileValue(out, self.kinds[out.id], ARRAY, -1, e + 1, self.smem)
            self.smem += _pad(4 * self.ta)
            self._step(e, ALONG_B)["ops"].append(op)
        elif src == FULL and d == B:        # over a, for each b: partials, then combined
            self.tv[out.id] = TileValue(out, self.kinds[out.id], ARRAY, -1, e + 2, self.smem)
            self.smem += _pad(4 * self.tb)
            self.partials.append(out.id)
            self._step(e, ALONG_A)["ops"].append(op)
            self._step(e + 1, MAP_B)["finish"].append(op)
        elif src == FULL:                   # over the whole tile: per-warp partials
            self.tv[out.id] = TileValue(out, self.kinds[out.id], REG, e + 1)
            self.partials.append(out.id)
            self._step(e, EACH)["ops"].append(op)
            self._step(e + 1, ROW_STEP)["finish"].append(op)
        elif src in (A, B) and d == ROW:    # every warp reduces the axis itself: no barrier
            self.tv[out.id] = TileValue(out, self.kinds[out.id], REG, e)
            self._step(e, ROW_STEP)["ops"].append(op)
        else:
            raise Unplannable(ReasonKind.LAYOUT, f"{op.prim} over {reduced} of a value along {src or 'no axis'}")

    def schedule_stores(self) -> None:
        """Stores each region output in the first loop along its axes that can read it."""
        for v in self.region.outputs:
            d, t = self.dom(v.id), self.tv.get(self.root(v.id))
            if d in (A, B) and t is not None and t.home == ARRAY and t.domain == d:
                continue  # stored where its array is written
            loop = {FULL: EACH, A: MAP_A, B: MAP_B, ROW: ROW_STEP}[d]
            self._step(max(self._need(v, d), 0), loop)["stores"].append(v)

    def _ordered_steps(self) -> list[TileStep]:
        """The steps by epoch, each epoch's loops in the order the kernel runs them."""
        ordered = []
        loop_order = [ROW_STEP, EACH, ALONG_B, ALONG_A, MAP_A, MAP_B]
        for (e, loop) in sorted(self.steps, key=lambda k: (k[0], loop_order.index(k[1]))):
            s = self.steps[(e, loop)]
            ordered.append(TileStep(e, loop, tuple(s["ops"]), tuple(s["finish"]), tuple(s["stores"])))
        return ordered

    def plan(self, target: Target, fast_exp: bool) -> TilePlan:
        """The TilePlan of the scheduled steps, once their shared memory is shared out."""
        ta, tb, block, teams = self.ta, self.tb, self.block, self.teams
        nwarps = block // 32
        paired = takes_pairs(self.tv.values(), tb)
        n_slices = team_slices(ta, tb, paired) if teams > 1 else slices(block, tb, paired)
        ordered = self._ordered_steps()
        if teams > 1:
            ordered, rows = _each_along_a(ordered, block, tb, self.orders)
            n_slices = rows or n_slices
        producer = {op.outputs[0].id: op for op in self.compute}
        sizes = {t.value.id: _pad(4 * (ta if t.domain == A else tb)) for t in self.tv.values() if t.home == ARRAY}
        partial_sizes = {vid: _pad(4 * (n_slices * tb if self.tv[vid].domain == B else nwarps))
                         for vid in self.partials}
        tv, smem = _share_shared_memory(ordered, self.tv, producer, self.root, 2 * self.stage, sizes, partial_sizes)
        self.tv = tv
        if smem > MAX_TILE_SMEM:
            raise Unplannable(ReasonKind.RESOURCES,
                              f"a {ta}x{tb} tile needs {smem} bytes of shared memory (at most {MAX_TILE_SMEM})")
        mapping = self._mapping(target, smem, paired, n_slices)
        epochs = max([s.epoch for s in ordered] + [0])
        region, labels, orders = self.region, self.labels, self.orders
        return TilePlan(region, tuple(tv[v] for v in tv), tuple(ordered), mapping, tuple(self.alias.items()),
                        epochs, tuple((v.id, orders[v.id]) for v in region.outputs), fast_exp=fast_exp,
                        merged_store=any(len(x) == 2 and not x.startswith("n") for v in region.outputs
                                         for x in labels[v.id]),
                        one_warp=_one_warp_epochs(ordered, tv, producer, self.root))

    def _mapping(self, target: Target, smem: int, paired: bool, n_slices: int) -> TileMapping:
        """The launch shape: TEAMS tiles a block, `smem` bytes of shared memory each, one wave of blocks."""
        ta, tb, block, teams, n_rows = self.ta, self.tb, self.block, self.teams, self.n_rows
        group = lanes_per_a(block, ta, tb)
        threads, smem = block * teams, smem * teams
        if smem > target.smem_optin:
            raise Unplannable(ReasonKind.RESOURCES,
                              f"{teams} tiles of {ta}x{tb} a block need {smem} bytes of shared memory "
                              f"(a block may have {target.smem_optin})")
        per_sm = max(1, _resident_blocks(threads, smem, target))
        min_blocks = max(1, min(per_sm, self.tuning.min_threads // threads))
        grid = min(-(-n_rows // teams), target.sm_count * per_sm)  # one wave; compile_region sizes it off the cubin
        return TileMapping(n_rows, ta, tb, threads, grid, smem, min_blocks, group, self.stage, pairs=paired,
                           slices=n_slices, teams=teams)


def _each_along_a(steps: list[TileStep], team: int, tb: int, orders: dict[int, str]
                  ) -> tuple[list[TileStep], int]:
    """A warp's EACH loop that stores whole tiles and reduces nothing, and the ALONG_A loop of the
    same epoch, merged into one EACH_ALONG_A loop: its threads take `fixed_b_rows` rows of the tile
    at once, b fixed in each, and those rows are the ALONG_A slices (each thread folds the a it
    walks into its b's accumulators). Both loops read the same tile elements and the same arrays
    along a: DIEN's key gradient and its sums over the 50 steps (bfloat16, a warp a tile) read the
    keys and the probabilities once, not twice. Returns the steps and the slices the merged loops
    take (0: none merged; every merged epoch's rows must agree, as SLICES is the kernel's)."""
    rows = 0
    merged: dict[int, TileStep] = {}  # epoch -> its merged loop
    for s in steps:
        if s.loop != ALONG_A:
            continue
        each = [x for x in steps if x.epoch == s.epoch and x.loop == EACH and x.stores and not x.ops]
        if not each:
            continue
        r = fixed_b_rows(team, tb, store_width(tb, [orders[v.id] for v in each[0].stores],
                                               max(v.itemsize for v in each[0].stores)))
        if r and rows in (0, r):
            rows = r
            merged[s.epoch] = TileStep(s.epoch, EACH_ALONG_A, s.ops, (), each[0].stores)
    out = [merged[s.epoch] if s.loop == ALONG_A and s.epoch in merged else s
           for s in steps if not (s.loop == EACH and s.epoch in merged)]
    return out, rows


def store_width(tb: int, kinds: list[str], widest: int) -> int:
    """Consecutive b a thread of an EACH loop takes (1, 2, 4 or 8): the most that divide TB and keep
    each store's vector (`widest`: the largest item size stored) within 16 bytes, when every store
    (`kinds`: their axes in memory order) is a whole tile in (n, a, b) order (its vectors then lie
    inside one row of the tile, aligned as the tile is); 1 without stores."""
    if not kinds or any(k != N + A + B for k in kinds):
        return 1
    for width in (8, 4, 2):
        if tb % width == 0 and width * widest <= 16:
            return width
    return 1


def fixed_b_rows(team: int, tb: int, width: int) -> int:
    """Rows of the tile a warp's EACH loop of `width` b a thread takes at once, b fixed in each
    thread (its stashed inputs along b read once, before the loop), where that keeps 3/4 of the
    threads busy; 0: the loop walks the tile flat instead."""
    lanes = tb // width
    rows = team // lanes if width > 1 else 0
    return rows if rows and 4 * rows * lanes >= 3 * team else 0


def _share_shared_memory(steps: list[TileStep], tv: dict[int, TileValue], producer: dict[int, ir.Op], root,
                          base: int, sizes: dict[int, int], partial_sizes: dict[int, int]
                          ) -> tuple[dict[int, TileValue], int]:
    """Offsets for the shared arrays (`sizes`) and reductions' partials (`partial_sizes`) after the
    stage buffers (`base` bytes): each lives from the epoch that writes it to the last that reads
    it, and two share bytes only where their epochs do not meet (a barrier ends every epoch). First
    fit, largest first. Returns the values with their offsets and the bytes a tile needs. DIEN's
    bfloat16 tile on a warp: 10176 -> 9344 bytes (its partials take the scores' space, its sums over
    a the probabilities'), so six blocks of four warps fit an H100 SM where five did (GPU time 53.5
    -> 54.0 us, on two machines: the kernel is not bound by its warps an SM)."""
    read_in = _read_epochs(steps, tv, producer, root)
    lives = []  # (first epoch, last epoch, bytes, value id, partials?)
    for vid, n in sizes.items():
        t = tv[vid]
        first = t.array_epoch - 1
        last = max([e for e in read_in.get(vid, ()) if e >= t.array_epoch], default=first)
        lives.append((first, last, n, vid, False))
    for vid, n in partial_sizes.items():
        t = tv[vid]
        first = t.array_epoch - 2 if t.home == ARRAY else t.epoch - 1
        lives.append((first, first + 1, n, vid, True))
    placed: list[tuple[int, int, int, int]] = []  # (offset, bytes, first, last)
    end = base
    for first, last, n, vid, partial in sorted(lives, key=lambda x: (-x[2], x[0], x[3], x[4])):
        meets = sorted((o, b) for o, b, f, l in placed if f <= last and first <= l)
        offset = base
        for o, b in meets:
            if offset + n <= o:
                break
            offset = max(offset, o + b)
        placed.append((offset, n, first, last))
        end = max(end, offset + n)
        tv[vid] = dataclasses.replace(tv[vid], **({"partial_offset": offset} if partial else {"offset": offset}))
    return tv, end


def _read_epochs(steps: list[TileStep], tv: dict[int, TileValue], producer: dict[int, ir.Op], root
                 ) -> dict[int, set[int]]:
    """The epochs in which each value is read: by a step's ops and stores, and through the inline
    values they compute again (an array read before its epoch is one of them). A step's `finish`
    reads its reductions' partials alone, not their operands."""
    read: dict[int, set[int]] = {}
    for s in steps:
        values = [a for op in s.ops for a in op.inputs if isinstance(a, ir.Value)] + list(s.stores)

        def recomputed(t: TileValue, e: int = s.epoch) -> bool:
            return t.home == INLINE or (t.home == ARRAY and 0 <= e < t.array_epoch and t.epoch >= 0)
        for vid in _reached(values, tv, producer, root, recomputed):
            read.setdefault(vid, set()).add(s.epoch)
    return read


def _reached(values, tv: dict[int, TileValue], producer: dict[int, ir.Op], root, recomputed) -> set[int]:
    """The root ids of `values` and of the values read to compute again those `recomputed(t)`
    accepts, through their producers."""
    todo, seen = list(values), set()
    while todo:
        vid = root(todo.pop().id)
        if vid in seen:
            continue
        seen.add(vid)
        t = tv.get(vid)
        if t is not None and recomputed(t) and vid in producer:
            todo.extend(a for a in producer[vid].inputs if isinstance(a, ir.Value))
    return seen


def _one_warp_epochs(steps: list[TileStep], tv: dict[int, TileValue], producer: dict[int, ir.Op],
                     root) -> tuple[int, ...]:
    """Epochs of row-scalar reductions and maps along one axis only, whose registers no later epoch
    reads: every warp would reduce the same values into the same registers, so the first warp runs
    them alone (its maps then walk the axis by lanes) and the others wait at the epoch's barrier.
    DIEN's softmax statistics, bfloat16: 83.8 -> 70.0 us (H100)."""
    chosen = []
    for e in sorted({s.epoch for s in steps}):
        here = [s for s in steps if s.epoch == e]
        reduces = any(s.loop == ROW_STEP and any(op.prim in opdefs.REDUCTIONS for op in s.ops) for s in here)
        if not reduces or any(s.loop not in (ROW_STEP, MAP_A, MAP_B) for s in here):
            continue
        made = {op.outputs[0].id for s in here if s.loop == ROW_STEP for op in s.ops + s.finish}
        if not made & _reads(steps, e, tv, producer, root):
            chosen.append(e)
    return tuple(chosen)


def _reads(steps: list[TileStep], after: int, tv: dict[int, TileValue], producer: dict[int, ir.Op],
           root) -> set[int]:
    """The values steps after epoch `after` read, through the inline values they recompute."""
    values = [a for s in steps if s.epoch > after for op in s.ops + s.finish
              for a in op.inputs if isinstance(a, ir.Value)]
    values += [v for s in steps if s.epoch > after for v in s.stores]
    return _reached(values, tv, producer, root, lambda t: t.home == INLINE)


def _names_its_operand(op: ir.Op) -> bool:
    """A layout op or a transpose: in a tile, its result is its operand under another name."""
    return (opdefs.is_layout(op) or op.prim == "transpose") and isinstance(op.inputs[0], ir.Value)


def _transposed(order: str) -> str:
    """`order` if it runs b before a (a transposed tile), else "" (the tile's own order)."""
    return order if order.endswith(B + A) else ""


def one_wave(mapping: TileMapping, registers: int, target: Target) -> TileMapping:
    """The grid as the blocks resident at once, from the compiled kernel's registers per thread
    (allocated per warp in units of 256), its shared memory and block size: each block walks its
    tiles with the next one's inputs in flight."""
    per_sm = min(_resident_blocks(mapping.block, mapping.smem_bytes, target),
                 target.blocks_by_registers(mapping.block, registers) if registers else 32)
    tiles = -(-mapping.n_rows // mapping.teams)
    return dataclasses.replace(mapping, grid=max(1, min(tiles, per_sm * target.sm_count)))


def _resident_blocks(threads: int, smem: int, target: Target) -> int:
    """Blocks of `threads` with `smem` bytes of shared memory an SM holds (registers aside)."""
    return min(target.max_threads_per_sm // threads, target.smem_per_sm // (smem + SMEM_PER_BLOCK_SYSTEM))


def lanes_per_a(block: int, ta: int, tb: int) -> int:
    """ALONG_B loops give each a a group of lanes (a power of two, at most a warp) that walk its b
    and combine by shuffles: as few as let every a have a group at once, so that each lane sums
    many b (a lane's loads and adds, not shuffles, do the work)."""
    group = 1
    while group < 32 and ta * group * 2 <= block and group < tb:
        group *= 2
    return group


def takes_pairs(values, tb: int) -> bool:
    """Whether loops along b take two consecutive b a step: the tile's width is even and a 2-byte
    input lies in shared memory in tile order. DIEN's attention in bfloat16: 73.2 -> 69.5 us (H100),
    though its SASS still loads the two elements as two 2-byte loads."""
    return tb % 2 == 0 and any(t.home == STASH and t.domain == FULL and not t.order and t.value.itemsize == 2
                               and not t.wide for t in values)


def slices(block: int, tb: int, pairs: bool = False) -> int:
    """ALONG_A loops give each b (each pair of b, with pairs) `slices` threads (consecutive threads,
    consecutive b), each summing every slices-th a; their partials are combined in slice order.
    Counted by pairs where a thread takes two b: counted by b, DIEN's 36 columns kept 54 of 128
    threads busy (3 slices) and the block's other warps waited at the epoch's barrier."""
    return max(1, block // (tb // 2 if pairs else tb))


def team_slices(ta: int, tb: int, pairs: bool = False, most: int = 8) -> int:
    """`slices` for a warp's tile: the count (up to `most`) that gives a lane the fewest steps, its
    rounds over the (b, slice) pairs times each slice's a, plus the slices each b's partials combine.
    DIEN's 36 columns in pairs: 3 slices (54 pairs of threads' work in 2 rounds of 32, 17 a each),
    where one slice would keep 18 of 32 lanes busy for all 50."""
    columns = tb // 2 if pairs else tb

    def steps(s: int) -> int:
        return -(-s * columns // 32) * -(-ta // s) + -(-tb // 32) * s
    return min(range(1, most + 1), key=lambda s: (steps(s), s))


def _pad(n: int) -> int:
    return -(-n // 16) * 16


def _block(tuning: Tuning) -> int:
    return max(64, min(TILE_BLOCK, tuning.max_tpr))


def estimate(plan: TilePlan, target: Target) -> Estimate:
    """Ours: each input and output moves once. XLA's: one kernel per pass over the tile-wide inputs
    (a reduction of them whose result comes back to the tile starts another pass), plus one for the
    small reductions between passes (a softmax along a), each pass re-reading the tile."""
    bw = target.bandwidth_gbs * 1e3
    region = plan.region
    must_move = sum(v.nbytes for v in region.inputs) + sum(v.nbytes for v in region.outputs)
    ours = must_move / (bw * TILE_EFFICIENCY) + target.launch_us
    tiled = (EACH, ALONG_A, ALONG_B, EACH_ALONG_A)
    passes = len({s.epoch for s in plan.steps if s.loop in tiled and (s.ops or s.stores)})
    small = any(op.prim in opdefs.REDUCTIONS for s in plan.steps if s.loop == ROW_STEP for op in s.ops)
    kernels = max(1, passes) + (1 if passes > 1 and small else 0)
    full_in = sum(v.nbytes for v in region.inputs if plan.of(v).domain == FULL)
    # A reduction chain whose result is stored transposed with the tile's axes merged ([B, T, D] ->
    # [B, D * T]) is one XLA kernel (H100, a layer norm over D, [16384, 50, 36]: 119 / 68 us float32
    # / bfloat16, 66% / 58% of the roofline; stored [B, D, T] instead, XLA takes 5 kernels, 270 /
    # 207 us): such regions count XLA as one pass (ours measured 1.22x / 0.85x there).
    if plan.merged_store:
        passes, kernels = 1, 1
    xla_bytes = must_move + max(0, passes - 1) * full_in
    middle = any(s.loop in (ALONG_A, EACH_ALONG_A) and s.ops for s in plan.steps)
    ragged = plan.mapping.tile_b % XLA_COLUMN_TILE != 0
    xla = xla_bytes / (bw * (XLA_MIDDLE_AXIS_EFFICIENCY if middle and ragged else XLA_EFFICIENCY)) \
        + kernels * target.launch_us
    return Estimate(must_move, ours, kernels, xla_bytes, xla)
