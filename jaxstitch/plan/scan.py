"""Persistent scans: a whole `lax.scan` of a small recurrent body as one kernel.

Why: a recurrent cell (DIEN's GRUs over 50 steps, 256 x 36) is a few microseconds of work a step,
yet XLA runs it as a while loop of ~4-7 launches plus loop control per step (~15-25 us a step on an
H100): the loop, not memory, bounds it. Here each block owns a slice of the batch rows and runs every
step itself, its carries and temporaries in shared memory, its weights staged once.

The batch is found, not declared: a dimension size shared by the carries and per-step inputs such that
every body op keeps rows apart (`_kinds`). Each body value is then
- BATCHED along an axis: the block holds its rows of it;
- UNIFORM: the same in every block, held whole (weights, values computed from them);
- SCALAR: one value broadcast (a literal, or a size-1 value), kept in a register;
- PARTIAL: a sum over rows (a weight gradient `h^T @ dg`, a bias gradient): each block holds its rows'
  share. Partials may only be added up into a carry (a gradient accumulated over the steps), which
  the blocks then combine in a fixed order after the last step (deterministic, one grid barrier).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter

from ..core import ir
from ..core import ops as opdefs
from ..core.targets import Target
from ..graph.partition import Region
from . import cost
from .layout import ReasonKind, Unplannable

BATCHED, UNIFORM, SCALAR, PARTIAL = "batched", "uniform", "scalar", "partial"
# Ops that only rename a value's elements (same row-major order): a stored value's alias.
RENAMES = frozenset({"reshape", "squeeze", "expand_dims", "copy", "copy_p", "stop_gradient"})
SHAPED = frozenset({"broadcast_in_dim", "transpose", "split", "slice", "concatenate", "dot_general"})
REDUCES = frozenset({"reduce_sum", "reduce_max", "reduce_min"})
# Linear ops a partial sum may pass through on its way to the carry that accumulates it.
_LINEAR = frozenset({"add", "add_any", "sub", "neg", "mul", "transpose", "convert_element_type"}) | RENAMES


@dataclasses.dataclass(frozen=True)
class Kind:
    kind: str
    axis: int | None = None  # BATCHED: the batch axis


@dataclasses.dataclass(frozen=True)
class ScanMapping:
    """The launch: `grid` blocks of `block` threads, `rows` batch rows each."""

    grid: int
    block: int
    rows: int             # batch rows a block owns
    batch: int            # all batch rows (1: no batch axis, one block runs everything)
    length: int           # steps
    smem_bytes: int
    cooperative: bool     # partial sums meet across blocks after the last step (one grid barrier)
    name: str = "scan"

    @property
    def n_rows(self) -> int:
        return self.batch

    @property
    def n_cols(self) -> int:
        return self.length


@dataclasses.dataclass(frozen=True)
class InPlaceSum:
    """`carry + dot(...)` (or `+ transpose(dot(...))`) where the carry is a per-block sum over rows
    that nothing else reads: the product is added into the carry's array as it is computed, with
    no array of its own, no transpose pass, no add pass and no copy into the carry after the step
    (DIEN's backward GRU: `dW += h^T @ dg`, three passes over [36, 108] a step fewer)."""

    carry: int                    # the carry's body input id: its array is updated in place
    dot: int                      # the dot_general's index in body.ops
    perm: tuple[int, ...] | None  # the transpose's permutation between product and add, if any
    elided: tuple[int, ...]       # indices in body.ops of the ops not emitted (transpose, add)


@dataclasses.dataclass(frozen=True)
class ScanPlan:
    region: Region                # the scan op alone, its inputs and outputs
    body: ir.Graph                # the step: (consts, carries, xs[t]) -> (carries, ys[t])
    reverse: bool
    num_consts: int
    num_carry: int
    kinds: tuple[tuple[int, Kind], ...]   # body value id -> kind
    # per body input: the region input it reads (an index), or the literal the scan passed
    sources: tuple[int | ir.Const, ...]
    mapping: ScanMapping
    workspace_bytes: int
    in_place: tuple[InPlaceSum, ...] = ()
    scheme: str = "scan"

    @functools.cached_property
    def elided(self) -> frozenset[int]:
        """Indices in body.ops of the ops not emitted: those after a product summed in place."""
        return frozenset(i for s in self.in_place for i in s.elided)

    @functools.cached_property
    def _kind_of(self) -> dict[int, Kind]:
        return dict(self.kinds)

    def kind(self, a: ir.Atom) -> Kind:
        if isinstance(a, ir.Const):
            return Kind(SCALAR)
        return self._kind_of[a.id]

    def local_shape(self, v: ir.Value) -> tuple[int, ...]:
        """A value's shape in one block's storage: its batch axis cut to the block's rows."""
        return block_shape(v, self.kind(v), self.mapping.rows)

    def row_axis(self, a: ir.Atom) -> int | None:
        """The axis along which a block holds (or writes) only its own rows: a batched value's, or
        a broadcast's that has the batch size (its rows are the block's); None: whole."""
        k = self.kind(a)
        if k.kind == BATCHED:
            return k.axis
        batch = self.mapping.batch
        if k.kind == SCALAR and batch > 1 and isinstance(a, ir.Value) and batch in a.shape:
            return a.shape.index(batch)
        return None

    def rows_shape(self, a: ir.Value) -> tuple[int, ...]:
        """What one block writes of a result: its rows along `row_axis`, or the whole value."""
        return cut(a.shape, self.row_axis(a), self.mapping.rows)

    @property
    def carries(self) -> tuple[tuple[ir.Value, ir.Atom], ...]:
        """(carry's value in the body, the body's value for it after a step)."""
        ins = self.body.inputs[self.num_consts:self.num_consts + self.num_carry]
        return tuple(zip(ins, self.body.outputs[:self.num_carry]))

    @property
    def xs(self) -> tuple[ir.Value, ...]:
        return self.body.inputs[self.num_consts + self.num_carry:]

    @property
    def ys(self) -> tuple[ir.Atom, ...]:
        return self.body.outputs[self.num_carry:]

    @property
    def description(self) -> str:
        m = self.mapping
        rows = f"{m.batch} rows as {m.grid} blocks of {m.rows}" if m.batch > 1 else "one block"
        acc = sum(self.kind(v).kind == PARTIAL for v, _ in self.carries)
        sums = f", {acc} sums over rows combined after the last step" if acc else ""
        return f"persistent scan: {m.length} steps of {len(self.body.ops)} ops, {rows}{sums}"


def cut(shape: tuple[int, ...], axis: int | None, rows: int) -> tuple[int, ...]:
    """`shape` with its axis `axis` (None: none) cut to a block's `rows`."""
    return shape if axis is None else tuple(rows if d == axis else n for d, n in enumerate(shape))


def block_shape(v: ir.Value, kind: Kind, rows: int) -> tuple[int, ...]:
    """A value's shape in one block's storage: batched values are cut to the block's rows."""
    return cut(v.shape, kind.axis if kind.kind == BATCHED else None, rows)


def check_body(body: ir.Graph) -> None:
    """Raises Unplannable where a scan body cannot run inside one kernel."""
    for op in body.ops:
        if op.prim not in opdefs.ELEMENTWISE | RENAMES | SHAPED | REDUCES:
            raise Unplannable(ReasonKind.OP, f"{op.prim} in the scan body")
        if op.prim == "dot_general" and any(op.param("dimension_numbers", ((), ()))[1]):
            raise Unplannable(ReasonKind.OP, "a batched dot_general in the scan body")
        if op.prim == "reshape" and op.param("dimensions") is not None:
            raise Unplannable(ReasonKind.OP, "a reshape that permutes dimensions in the scan body")
        for v in op.inputs + op.outputs:
            if v.dtype not in ir.SUPPORTED_DTYPES:
                raise Unplannable(ReasonKind.DTYPE, f"a {v.dtype} value in the scan body")
            if isinstance(v, ir.Value) and not all(isinstance(d, int) for d in v.shape):
                raise Unplannable(ReasonKind.SCAN, "symbolic sizes in the scan body")
    if any(isinstance(a, ir.Const) for a in body.outputs):
        raise Unplannable(ReasonKind.SCAN, "a literal result of the scan body")


def _dot_dims(op: ir.Op):
    (lc, rc), _ = op.param("dimension_numbers")
    return tuple(lc), tuple(rc)


def _free(rank: int, contracted) -> list[int]:
    return [d for d in range(rank) if d not in contracted]


def _op_kind(op: ir.Op, ks: list[Kind], batch: int) -> Kind | list[Kind]:
    """The kind of `op`'s result(s) given its operands' kinds; Unplannable where rows would mix."""
    prim = op.prim
    kinds = {k.kind for k in ks}
    out = op.outputs[0]
    if PARTIAL in kinds and prim not in _LINEAR:
        raise Unplannable(ReasonKind.SCAN, f"a sum over rows read by {prim}")
    if prim in opdefs.ELEMENTWISE or prim in RENAMES:
        return _elementwise_kind(op, ks, kinds, out, batch)
    if prim == "broadcast_in_dim":
        return _broadcast_kind(op, ks)
    if prim == "transpose":
        return _transpose_kind(op, ks)
    if prim in ("split", "slice"):
        return _split_or_slice_kind(op, ks, batch)
    if prim == "concatenate":
        return _concatenate_kind(op, ks, kinds)
    if prim == "dot_general":
        return _dot_kind(op, ks, kinds)
    if prim in REDUCES:
        return _reduce_kind(op, ks)
    raise Unplannable(ReasonKind.OP, f"{prim} in the scan body")


def _elementwise_kind(op: ir.Op, ks: list[Kind], kinds: set[str], out: ir.Value, batch: int) -> Kind:
    """_op_kind of an elementwise op or a rename: its rows are its operands' rows."""
    prim = op.prim
    if PARTIAL in kinds:
        return _partial_elementwise_kind(prim, ks, kinds, out)
    if prim in RENAMES:
        return _rename_kind(op, ks[0], out, batch)
    batched = [k for k in ks if k.kind == BATCHED]
    if batched:
        if len({k.axis for k in batched}) > 1:
            raise Unplannable(ReasonKind.SCAN, f"{prim} of values batched along different axes")
        axis = batched[0].axis
        # (a whole value may join rows where lax broadcasts it along them: size 1 there)
        if any(k.kind == UNIFORM and a.shape[axis] != 1 for a, k in zip(op.inputs, ks)):
            raise Unplannable(ReasonKind.SCAN, f"{prim} of rows with a whole value")
        return batched[0]
    return Kind(UNIFORM) if UNIFORM in kinds else Kind(SCALAR)


def _partial_elementwise_kind(prim: str, ks: list[Kind], kinds: set[str], out: ir.Value) -> Kind:
    """An elementwise op reading a sum over rows: only linear uses keep it a (partial) sum."""
    if prim == "mul" and sum(k.kind == PARTIAL for k in ks) == 1 and kinds <= {PARTIAL, SCALAR, UNIFORM}:
        return Kind(PARTIAL)
    if prim in ("add", "add_any", "sub") and kinds == {PARTIAL}:
        return Kind(PARTIAL)
    if prim in ("neg",) or prim in RENAMES:
        return Kind(PARTIAL)
    if prim == "convert_element_type" and out.dtype in ir.FLOAT_DTYPES:
        return Kind(PARTIAL)
    raise Unplannable(ReasonKind.SCAN, f"a sum over rows in {prim} with other values")


def _rename_kind(op: ir.Op, k: Kind, out: ir.Value, batch: int) -> Kind:
    """A rename keeps the batch axis only where it stays a whole axis of its own (same elements before it)."""
    if k.kind != BATCHED:
        return k
    shape = op.inputs[0].shape
    before = math.prod(shape[:k.axis])
    for d in range(len(out.shape)):
        if out.shape[d] == batch and math.prod(out.shape[:d]) == before:
            return Kind(BATCHED, d)
    raise Unplannable(ReasonKind.SCAN, f"{op.prim} {shape} -> {out.shape} merges the batch axis")


def _broadcast_kind(op: ir.Op, ks: list[Kind]) -> Kind:
    """A broadcast moves the batch axis to where broadcast_dimensions puts it; of one value, a scalar."""
    k, src = ks[0], op.inputs[0]
    if k.kind == SCALAR or (k.kind == UNIFORM and isinstance(src, ir.Value) and src.size == 1):
        return Kind(SCALAR)
    if k.kind == BATCHED:
        return Kind(BATCHED, op.param("broadcast_dimensions")[k.axis])
    return k


def _transpose_kind(op: ir.Op, ks: list[Kind]) -> Kind:
    """A transpose moves the batch axis with its permutation."""
    k = ks[0]
    if k.kind == SCALAR:
        raise Unplannable(ReasonKind.SCAN, "a transposed broadcast")
    perm = op.param("permutation")
    return Kind(BATCHED, perm.index(k.axis)) if k.kind == BATCHED else k


def _split_or_slice_kind(op: ir.Op, ks: list[Kind], batch: int) -> list[Kind]:
    """A split or slice keeps its operand's kind, unless it cuts the batch axis (rows would move between blocks)."""
    prim, k = op.prim, ks[0]
    if k.kind == SCALAR:
        raise Unplannable(ReasonKind.SCAN, f"{prim} of a broadcast")
    if k.kind == BATCHED:
        if prim == "split" and op.param("axis") == k.axis:
            raise Unplannable(ReasonKind.SCAN, "a split along the batch axis")
        if prim == "slice":
            start, limit = op.param("start_indices"), op.param("limit_indices")
            strides = op.param("strides") or (1,) * len(start)
            if (start[k.axis], limit[k.axis], strides[k.axis]) != (0, batch, 1):
                raise Unplannable(ReasonKind.SCAN, "a slice of the batch axis")
    return [k] * len(op.outputs)


def _concatenate_kind(op: ir.Op, ks: list[Kind], kinds: set[str]) -> Kind:
    """A concatenate keeps rows apart only joining values batched alike, along another axis."""
    if SCALAR in kinds:
        raise Unplannable(ReasonKind.SCAN, "a concatenated broadcast")
    if kinds == {UNIFORM}:
        return Kind(UNIFORM)
    if UNIFORM in kinds or len({k.axis for k in ks}) > 1 or ks[0].axis == op.param("dimension"):
        raise Unplannable(ReasonKind.SCAN, "a concatenate that mixes rows")
    return ks[0]


def _dot_kind(op: ir.Op, ks: list[Kind], kinds: set[str]) -> Kind:
    """A product of rows with a whole value stays batched; of rows with rows over the batch axis, a sum over rows."""
    lk, rk = ks
    lc, rc = _dot_dims(op)
    if SCALAR in kinds:
        raise Unplannable(ReasonKind.SCAN, "a dot_general of a broadcast")
    lfree, rfree = _free(len(op.inputs[0].shape), lc), _free(len(op.inputs[1].shape), rc)
    if lk.kind == BATCHED and rk.kind == BATCHED:
        if lk.axis in lc and rk.axis == rc[lc.index(lk.axis)]:
            return Kind(PARTIAL)
        raise Unplannable(ReasonKind.SCAN, "a dot_general of two batched values that is not a sum over rows")
    if lk.kind == BATCHED:
        if lk.axis in lc:
            raise Unplannable(ReasonKind.SCAN, "a dot_general contracting rows with a whole value")
        return Kind(BATCHED, lfree.index(lk.axis))
    if rk.kind == BATCHED:
        if rk.axis in rc:
            raise Unplannable(ReasonKind.SCAN, "a dot_general contracting rows with a whole value")
        return Kind(BATCHED, len(lfree) + rfree.index(rk.axis))
    return Kind(UNIFORM)


def _reduce_kind(op: ir.Op, ks: list[Kind]) -> Kind:
    """A reduction over other axes keeps rows apart; a sum over the batch axis is a sum over rows."""
    prim = op.prim
    k, axes = ks[0], tuple(op.param("axes"))
    if k.kind == SCALAR:
        raise Unplannable(ReasonKind.SCAN, f"{prim} of a broadcast")
    if k.kind == BATCHED:
        if k.axis in axes:
            if prim != "reduce_sum":
                raise Unplannable(ReasonKind.SCAN, f"{prim} over rows")
            return Kind(PARTIAL)
        return Kind(BATCHED, k.axis - sum(a < k.axis for a in axes))
    return k


def _kinds(body: ir.Graph, inputs: list[Kind], batch: int, carries=frozenset()) -> dict[int, Kind]:
    """Each body value's kind; `carries`: ids of the carries' values, which a sum over rows may be
    added to (the carry is then taken as a partial sum itself: find_kinds' next round)."""
    kinds = {v.id: k for v, k in zip(body.inputs, inputs)}
    for op in body.ops:
        ks = [Kind(SCALAR) if isinstance(a, ir.Const) else kinds[a.id] for a in op.inputs]
        if (op.prim in ("add", "add_any") and {k.kind for k in ks} == {UNIFORM, PARTIAL}
                and all(k.kind == PARTIAL or a.id in carries for a, k in zip(op.inputs, ks))):
            kinds[op.outputs[0].id] = Kind(PARTIAL)
            continue
        got = _op_kind(op, ks, batch)
        for o, k in zip(op.outputs, got if isinstance(got, list) else [got] * len(op.outputs)):
            kinds[o.id] = k
    return kinds


def _input_kinds(body: ir.Graph, num_consts: int, batch: int, partial: frozenset[int]) -> list[Kind]:
    out = []
    for i, v in enumerate(body.inputs):
        if i >= num_consts and i in partial:
            out.append(Kind(PARTIAL))
        elif i >= num_consts and batch > 1 and batch in v.shape:
            out.append(Kind(BATCHED, v.shape.index(batch)))
        else:
            out.append(Kind(UNIFORM))
    return out


def find_kinds(body: ir.Graph, num_consts: int, num_carry: int) -> list[tuple[int, dict[int, Kind]]]:
    """[(batch size, each body value's kind)] for each size among the carries' and per-step
    inputs' under which rows never mix (most common sizes first), and for 1 (no batch axis)."""
    sizes = Counter(d for v in body.inputs[num_consts:] for d in set(v.shape) if d > 1)
    carries = frozenset(v.id for v in body.inputs[num_consts:num_consts + num_carry])
    why: Unplannable | None = None  # (the first reason met)
    found = []
    for batch in [b for b, _ in sizes.most_common()] + [1]:
        partial: frozenset[int] = frozenset()
        for _ in range(num_carry + 1):
            try:
                kinds = _kinds(body, _input_kinds(body, num_consts, batch, partial), batch, carries)
            except Unplannable as e:
                why = why or e
                break
            grew = _check_carries(body, num_consts, num_carry, kinds, partial)
            if grew is None:
                try:
                    _check_ys(body, num_carry, kinds)
                    found.append((batch, kinds))
                except Unplannable as e:
                    why = why or e
                break
            partial = grew
    if not found:
        raise why or Unplannable(ReasonKind.SCAN, "no batch axis keeps the rows apart")
    return found


def _check_carries(body, num_consts, num_carry, kinds, partial) -> frozenset[int] | None:
    """None if every carry keeps its kind across a step; else the carries to take as partial sums
    (a whole value that a step adds a sum over rows to), or Unplannable."""
    grow = set(partial)
    for j in range(num_carry):
        v, out = body.inputs[num_consts + j], body.outputs[j]
        kin, kout = kinds[v.id], Kind(SCALAR) if isinstance(out, ir.Const) else kinds[out.id]
        if kout == kin or (kout.kind == SCALAR and kin.kind != PARTIAL):
            continue
        if kout.kind == PARTIAL and kin.kind == UNIFORM and v.dtype in ir.FLOAT_DTYPES:
            grow.add(num_consts + j)
            continue
        raise Unplannable(ReasonKind.SCAN, f"carry {j} is {kin.kind} going in and {kout.kind} coming out of a step")
    return None if grow == set(partial) else frozenset(grow)


def _check_carry_sources(body, num_consts, num_carry):
    """A step's carries are copied into place one after another; a carry that takes another
    carry's value (a shift register: (a, b) -> (x, a)) would read it overwritten."""
    carried = {v.id: j for j, v in enumerate(body.inputs[num_consts:num_consts + num_carry])}
    renamed = {op.outputs[0].id: op.inputs[0].id for op in body.ops
               if op.prim in RENAMES and isinstance(op.inputs[0], ir.Value)}
    for j, out in enumerate(body.outputs[:num_carry]):
        src = out.id if isinstance(out, ir.Value) else None
        while src in renamed:
            src = renamed[src]
        if carried.get(src, j) != j:
            raise Unplannable(ReasonKind.SCAN, f"carry {j} takes carry {carried[src]}'s value")


def _check_ys(body, num_carry, kinds):
    for y in body.outputs[num_carry:]:
        if kinds[y.id].kind == PARTIAL:
            raise Unplannable(ReasonKind.SCAN, "a per-step result that is a sum over rows")


def stored(plan_kinds: dict[int, Kind], body: ir.Graph, in_place=()) -> list[ir.Value]:
    """Values that get a shared-memory array: every input, and every op result but scalars,
    renames (which share their operand's array) and the products summed into a carry in place
    (with the ops after them that are not emitted)."""
    skip = {i for s in in_place for i in (s.dot, *s.elided)}
    out = list(body.inputs)
    for i, op in enumerate(body.ops):
        if op.prim in RENAMES or i in skip:
            continue
        out += [o for o in op.outputs if plan_kinds[o.id].kind != SCALAR]
    return out


def in_place_sums(body: ir.Graph, num_consts: int, num_carry: int, kinds: dict[int, Kind]) -> tuple[InPlaceSum, ...]:
    """The floating-point sum-over-rows carries whose step is `carry + [transpose](dot(...))`, each
    value on that path read once (by the next op on it, the carry's new value by the scan alone).
    Every value lives in shared memory as float (half-precision ones too), so the product added in
    place is the same float sum as the written form's, in the same order: the same bits."""
    readers = Counter(a.id for op in body.ops for a in op.inputs if isinstance(a, ir.Value))
    readers.update(a.id for a in body.outputs if isinstance(a, ir.Value))
    producer = {o.id: (i, op) for i, op in enumerate(body.ops) for o in op.outputs}
    found = []
    carries = zip(body.inputs[num_consts:num_consts + num_carry], body.outputs[:num_carry])
    for v, new in carries:
        if (kinds[v.id].kind != PARTIAL or v.dtype not in ir.FLOAT_DTYPES or not isinstance(new, ir.Value)
                or new.id not in producer or readers[v.id] != 1 or readers[new.id] != 1):
            continue
        i_add, add = producer[new.id]
        rest = [a for a in add.inputs if not (isinstance(a, ir.Value) and a.id == v.id)]
        if add.prim not in ("add", "add_any") or len(add.inputs) != 2 or len(rest) != 1:
            continue
        x, perm, elided = rest[0], None, (i_add,)
        if not isinstance(x, ir.Value) or x.id not in producer or readers[x.id] != 1:
            continue
        i_x, op_x = producer[x.id]
        if op_x.prim == "transpose":
            y = op_x.inputs[0]
            if not isinstance(y, ir.Value) or y.id not in producer or readers[y.id] != 1:
                continue
            perm, elided = tuple(op_x.param("permutation")), (i_x, i_add)
            i_x, op_x = producer[y.id]
        if op_x.prim == "dot_general" and op_x.outputs[0].dtype == v.dtype:
            found.append(InPlaceSum(v.id, i_x, perm, elided))
    return tuple(found)


def plan_scan(region: Region, body: ir.Graph, target: Target, sums_in_place: bool = True
              ) -> tuple[ScanPlan, cost.Estimate]:
    """The scan `region.ops[0]` (body flattened to `body`) as one kernel, with its estimate;
    `sums_in_place`: products added to sum-over-rows carries go into them directly (InPlaceSum)."""
    op = region.ops[0]
    check_body(body)
    num_consts, num_carry, length = op.param("num_consts"), op.param("num_carry"), op.param("length")
    if None in (num_consts, num_carry, length):
        raise Unplannable(ReasonKind.SCAN,
                          "its operands' groups (consts, carries, per-step) are not known here "
                          "(symbolic sizes?)")
    if length < 1:
        raise Unplannable(ReasonKind.SCAN, "a scan of no steps")
    options = []
    for batch, kinds in find_kinds(body, num_consts, num_carry):
        rows = -(-batch // target.sm_count)
        in_place = in_place_sums(body, num_consts, num_carry, kinds) if sums_in_place else ()
        _, smem = shared_layout(stored(kinds, body, in_place), lambda v: _block_size(v, kinds, rows))
        options.append((smem, -batch, batch, kinds, rows, in_place))
    # the batch axis that leaves a block the least to hold (then the most blocks)
    smem, _, batch, kinds, rows, in_place = min(options, key=lambda o: o[:2])
    grid = -(-batch // rows)
    if smem > target.smem_optin:
        raise Unplannable(ReasonKind.RESOURCES,
                          f"a block would need {smem} bytes of shared memory (at most {target.smem_optin})")
    widest = max(_block_size(v, kinds, rows) for v in [*body.inputs, *(o for op in body.ops for o in op.outputs)])
    block = 256 if widest >= 256 else max(64, -(-widest // 32) * 32)
    partial = [v for v in body.inputs[num_consts:num_consts + num_carry] if kinds[v.id].kind == PARTIAL]
    workspace = sum(grid * v.size * 4 for v in partial)
    mapping = ScanMapping(grid, block, rows, batch, length, smem, bool(partial))
    _check_carry_sources(body, num_consts, num_carry)
    index = {v.id: i for i, v in enumerate(region.inputs)}
    sources = tuple(a if isinstance(a, ir.Const) else index[a.id] for a in op.inputs)
    if any(isinstance(a, ir.Const) for a in sources[num_consts + num_carry:]):
        raise Unplannable(ReasonKind.SCAN, "a literal per-step operand of the scan")
    plan = ScanPlan(region, body, bool(op.param("reverse")), num_consts, num_carry,
                    tuple(sorted(kinds.items())), sources, mapping, workspace, in_place)
    return plan, estimate(plan, target)


def _block_size(v: ir.Value, kinds: dict[int, Kind], rows: int) -> int:
    return math.prod(block_shape(v, kinds[v.id], rows))


def shared_layout(values, size) -> tuple[dict[int, int], int]:
    """Each value's byte offset in a block's shared memory (`size(v)` elements of 4 bytes, bools
    1, each array 16-byte aligned) and the bytes in all."""
    offsets, total = {}, 0
    for v in values:
        offsets[v.id] = total
        total += _aligned(size(v) * _itemsize(v))
    return offsets, total


def _itemsize(v: ir.Value) -> int:
    return 1 if v.dtype == "bool" else 4


def _aligned(n: int) -> int:
    return -(-n // 16) * 16


# What one step of a persistent scan costs in a block, and one iteration of XLA's while loop around
# its kernels (the target's calibration: scan_step_us, scan_op_us, scan_fma_per_us,
# xla_iteration_us). On an H100, ours: first guesses (0.4 and 0.03 us) times the 1.45 DIEN's GRU
# fwd+bwd measured over them; XLA's: a first guess, which came out 1.27x slow there, so the
# model still errs towards our kernel by that much.


def estimate(plan: ScanPlan, target: Target) -> cost.Estimate:
    """Ours: the steps one after another, each op a pass over a block's elements; XLA: per
    iteration its loop control and launches (one fusion a matrix product or reduction, one between),
    or its bytes and multiply-adds where they are larger."""
    m, body = plan.mapping, plan.body
    rates = target.calibration
    step, fmas, total_fmas, launches = rates.scan_step_us, 0, 0, 2
    for i, op in enumerate(body.ops):
        if op.prim in RENAMES or i in plan.elided:  # (elided: the product goes into its carry)
            continue
        out = op.outputs[0]
        per_thread = -(-max(plan_size(plan, o) for o in op.outputs) // m.block)
        inner = 1
        if op.prim == "dot_general":
            lc, _ = _dot_dims(op)
            inner = math.prod(plan.local_shape(op.inputs[0])[d] for d in lc)
            fmas += plan_size(plan, out) * inner
            total_fmas += out.size * math.prod(op.inputs[0].shape[d] for d in lc)
            launches += 2
        elif op.prim in REDUCES:
            inner = plan_size(plan, op.inputs[0]) // max(1, plan_size(plan, out))
            launches += 1
        step += rates.scan_op_us * per_thread * (1 + inner / 8)
    step = max(step, rates.scan_step_us + fmas / rates.scan_fma_per_us)
    moved = sum(v.nbytes for v in plan.region.inputs) + sum(v.nbytes for v in plan.region.outputs)
    ours = target.launch_us + m.length * step + (target.grid_sync_us if m.cooperative else 0.0)
    xla_step = max(rates.xla_iteration_us + launches * target.launch_us, total_fmas / 1.0e8)
    xla = m.length * xla_step + moved / (target.bandwidth_gbs * 1e3)
    return cost.Estimate(moved, ours, 1 + launches * m.length, moved, xla)


def plan_size(plan: ScanPlan, v: ir.Value) -> int:
    return _block_size(v, plan._kind_of, plan.mapping.rows)
