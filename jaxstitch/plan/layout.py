"""Place every value of a region in the (rows x cols) space of its kernel.

A region's kernel walks a 2-D space: N rows (the kept leading axes) times C columns (the reduced
trailing axes), both flattened in row-major order, so reshapes that only merge or split axes inside one
part move no data. Each value has a *declared* kind (what its shape spans) and a *storage* kind (what
it actually varies over: a broadcast row value stays one scalar per row in registers).
"""
from __future__ import annotations

import dataclasses
import enum
import math

from ..core import ir
from ..core import ops as opdefs
from ..graph.partition import Region

SCALAR, ROW, COL, FULL = "scalar", "row", "col", "full"
# An input read only through gathers (plan/views.py): it stays in global memory, in any shape.
MEMORY = "memory"
GATHER = "gather"
# The ops of a paired mapping (plan/pairs.py).
PAIR_SWAP, PAIR_HALF = "pair_swap", "pair_half"
EPILOGUE = -1  # level of values that exist only after the grid-wide reduction


class ReasonKind(str, enum.Enum):
    """What kind of obstacle keeps a region from being stitched: the report groups regions by it,
    and code tells reasons apart by it, never by their text."""

    LAYOUT = "layout"        # a value's shape or axes do not fit the kernel's rows x cols or tile space
    OP = "op"                # an op, or a form of one, the kernels do not implement
    DTYPE = "dtype"          # an op the kernels implement, but not for this dtype
    RESOURCES = "resources"  # shared memory, registers, threads or grid past what a block or SM has
    TILE = "tile"            # no batch of tiles at all (NotATile): a tile plan was never tried
    SCAN = "scan"            # a lax.scan whose steps would mix the rows its blocks own
    COST = "cost"            # planned, but the cost model leaves it to XLA (a RegionPlan's only)

    def __str__(self) -> str:
        return self.value


class Unplannable(Exception):
    """The region cannot be planned as one kernel: `kind` says what stands in the way, `detail` is the
    reason shown (str(e)), and `op_index` the traced equation it is about, where it names one (the
    report shows that equation's line in the user's source)."""

    def __init__(self, kind: ReasonKind, detail: str, *, op: ir.Op | None = None):
        super().__init__(detail)
        self.kind = ReasonKind(kind)
        self.detail = detail
        self.op_index = _op_index(op)

    def about(self, op: ir.Op) -> Unplannable:
        """This reason, naming `op` where it names no op yet (raised below the op it is about)."""
        if self.op_index is None:
            self.op_index = _op_index(op)
        return self


def _op_index(op: ir.Op | None) -> int | None:
    return op.index if op is not None and op.index >= 0 else None


def join(kinds) -> str:
    ks = frozenset(kinds) - {SCALAR}
    if not ks:
        return SCALAR
    if FULL in ks or ks == {ROW, COL}:
        return FULL
    return next(iter(ks))


@dataclasses.dataclass(frozen=True)
class Placed:
    value: ir.Value
    declared: str
    storage: str
    level: int
    iota: tuple[int, int] | None = None  # (stride, size) inside its part, for iota values


@dataclasses.dataclass(frozen=True)
class Layout:
    n_rows: int
    n_cols: int
    values: tuple[Placed, ...]

    def __post_init__(self):
        object.__setattr__(self, "_by_id", {p.value.id: p for p in self.values})

    def of(self, v: ir.Value) -> Placed:
        return self._by_id[v.id]

    @property
    def levels(self) -> int:
        return max((p.level for p in self.values), default=0)


def gathered_only(region: Region) -> frozenset[int]:
    """Ids of the inputs the region reads only through gathers."""
    direct = {a.id for op in region.ops for i, a in enumerate(op.inputs)
              if isinstance(a, ir.Value) and not (op.prim == GATHER and i == 0)}
    return frozenset(v.id for v in region.inputs if v.id not in direct)


def row_space(region: Region) -> tuple[int, int]:
    """(N, C): from the row reductions and scans if any, else a column reduction, else the largest value (of
    those the kernel holds: not inputs read only through gathers)."""
    shapes = set()
    for op in region.ops:
        if op.prim in opdefs.REDUCTIONS and opdefs.reduce_kind(op) == "row":
            s, axes = op.inputs[0].shape, op.param("axes")
            shapes.add((math.prod(d for i, d in enumerate(s) if i not in axes), math.prod(s[a] for a in axes)))
        elif op.prim in opdefs.SCANS:  # a scan runs along the row: its axis is the columns
            s = op.inputs[0].shape
            shapes.add((math.prod(s) // s[op.param("axis")], s[op.param("axis")]))
    if len(shapes) > 1:
        raise Unplannable(ReasonKind.LAYOUT, f"row reductions or scans over different row lengths {sorted(shapes)}")
    if shapes:
        return shapes.pop()
    for op in region.ops:
        if op.prim in opdefs.REDUCTIONS and opdefs.reduce_kind(op) == "grid":
            s, axes = op.inputs[0].shape, op.param("axes")
            reduced = math.prod(s[a] for a in axes)
            if reduced != math.prod(s):
                return reduced, math.prod(s) // reduced
    big = max((o for op in region.ops for o in op.outputs), key=lambda v: v.size)
    memory = gathered_only(region)
    biggest = max([big] + [v for v in region.inputs if v.id not in memory], key=lambda v: v.size)
    shape = biggest.shape or (1,)
    return math.prod(shape[:-1]), shape[-1]


def row_axes(shape, n_rows) -> int:
    """Index j where shape[:j] spans the rows (the first such j): the row and column axes of a full
    value."""
    prod = 1
    for j, d in enumerate(shape):
        if prod == n_rows:
            return j
        prod *= d
    if prod == n_rows:
        return len(shape)
    raise Unplannable(ReasonKind.LAYOUT, f"shape {shape} does not split into {n_rows} rows")


def _declared(v: ir.Value, n: int, c: int, hint: str | None = None, constant: bool = False,
              op: ir.Op | None = None) -> str:
    """The kind `v`'s shape spans; a constant (scalar storage) may take either reading of N == C."""
    size = v.size
    options = [k for k, s in ((SCALAR, 1), (FULL, n * c), (ROW, n), (COL, c)) if s == size]
    if not options:
        raise Unplannable(ReasonKind.LAYOUT,
                          f"value of shape {v.shape} is neither a row, a column, a scalar nor the full {n}x{c}",
                          op=op)
    if len(options) == 1:
        return options[0]
    if hint in options:
        return hint
    if constant:
        return options[-1]
    return options[0] if options[0] in (SCALAR, FULL) else _ambiguous(v, options, op)


def _ambiguous(v, options, op: ir.Op | None):
    raise Unplannable(ReasonKind.LAYOUT, f"shape {v.shape} is ambiguous between {' and '.join(options)}", op=op)


def place(region: Region, online_sums: frozenset[int] = frozenset()) -> Layout:
    """`online_sums`: outputs of row sums reduced in the same pass as the max they subtract
    (plan/online.py): they take the max's level, not one more."""
    n, c = row_space(region)
    placed: dict[int, Placed] = {}
    hints = _input_hints(region, n, c)
    memory = gathered_only(region)
    for v in region.inputs:
        if v.id in memory:
            placed[v.id] = Placed(v, MEMORY, MEMORY, 0)
            continue
        d = _declared(v, n, c, hints.get(v.id))
        placed[v.id] = Placed(v, d, d, 0)

    def get(a):
        return placed[a.id] if isinstance(a, ir.Value) else None

    for op in region.ops:
        ins = [get(a) for a in op.inputs]
        vals = [p for p in ins if p is not None]
        epi = bool(vals) and all(p.level == EPILOGUE for p in vals)
        # (partition keeps these apart; a merge across data-moving ops could bring them together)
        if not epi and any(p.level == EPILOGUE for p in vals):
            raise Unplannable(ReasonKind.LAYOUT, f"{op.prim} reads a grid-reduced value beside row work", op=op)
        level = EPILOGUE if epi else max((p.level for p in vals), default=0)
        out = op.outputs[0]
        if op.prim in opdefs.ELEMENTWISE:
            hint = vals[0].declared if vals else None
            storage = join(p.storage for p in vals)
            decl = _declared(out, n, c, hints.get(out.id, hint), constant=storage == SCALAR, op=op)
            if decl == FULL:  # (lax broadcasts size-1 dimensions of same-rank operands)
                for a, p in zip(op.inputs, ins):
                    if p is not None and p.declared in (ROW, COL) and len(a.shape) == len(out.shape):
                        _check_spread(p, [i for i, d in enumerate(a.shape) if d != 1], out, n, op)
            placed[out.id] = Placed(out, decl, storage, level)
        elif opdefs.is_layout(op) and not vals:  # a broadcast literal
            placed[out.id] = Placed(out, _declared(out, n, c, constant=True, op=op), SCALAR, 0)
        elif opdefs.is_layout(op):
            src = vals[0]
            decl = _declared(out, n, c, hints.get(out.id, src.declared if out.size == src.value.size else None), op=op)
            if op.prim == "broadcast_in_dim" and src.storage in (ROW, COL) and decl == FULL:
                _check_broadcast(op, src, n)
            placed[out.id] = Placed(out, decl, src.storage, level)
        elif op.prim == "iota":
            placed[out.id] = _place_iota(op, n, c)
        elif op.prim == PAIR_HALF:  # whether a column is in the second half of its pair group
            placed[out.id] = Placed(out, _declared(out, n, c, COL, op=op), COL, 0)
        elif op.prim == PAIR_SWAP:  # an array's partner columns, held by the same thread
            src = vals[0]
            placed[out.id] = Placed(out, _declared(out, n, c, src.declared, op=op), src.storage, src.level)
        elif op.prim == GATHER:  # a load at computed indices: its kind is its shape's
            decl = _declared(out, n, c, hints.get(out.id), op=op)
            placed[out.id] = Placed(out, decl, decl, max((p.level for p in vals[1:]), default=0))
        elif op.prim in opdefs.SCANS:  # each element from its row's elements before it: full
            if level == EPILOGUE or out.size != n * c:
                raise Unplannable(ReasonKind.LAYOUT, f"{op.prim} of a value that is not the full {n}x{c} rows", op=op)
            placed[out.id] = Placed(out, FULL, FULL, level)
        elif op.prim in opdefs.REDUCTIONS:
            operands = [get(a) for a in opdefs.reduced_operands(op) if isinstance(a, ir.Value)]
            for o in op.outputs:
                placed[o.id] = _place_reduction(op, o, operands, n, c)
            if out.id in online_sums:
                placed[out.id] = dataclasses.replace(placed[out.id], level=ins[0].level)
        else:
            raise Unplannable(ReasonKind.OP, f"{op.prim} has no placement rule", op=op)
        if any(o.size != out.size for o in op.outputs[1:]):
            raise Unplannable(ReasonKind.OP, f"{op.prim} has outputs of different sizes", op=op)
    for v in region.outputs:
        p = placed[v.id]
        if p.level != EPILOGUE and p.declared == COL and p.storage == FULL:
            raise Unplannable(ReasonKind.LAYOUT, "a column value varies over rows")
    return Layout(n, c, tuple(placed[v.id] for v in region.inputs)
                  + tuple(placed[o.id] for op in region.ops for o in op.outputs if o.id in placed))


def _input_hints(region: Region, n: int, c: int) -> dict[int, str]:
    """Row or column, for values whose size fits both (N == C), read off how they are used.

    Walks the ops backwards: an operand broadcast (explicitly, or by an elementwise op's size-1
    dimensions) into a full-size value is a row if its dimensions land before the row/column split;
    a value of the same size as a hinted broadcast, reshape or elementwise result takes that
    result's hint (a layernorm's gamma, converted to float32, then broadcast).
    """
    hints: dict[int, str] = {}
    for op in reversed(region.ops):
        out = op.outputs[0]
        operands = [a for a in op.inputs if isinstance(a, ir.Value) and a.size not in (1, n * c)]
        if out.size == n * c and (op.prim == "broadcast_in_dim" or op.prim in opdefs.ELEMENTWISE):
            j = row_axes(out.shape, n)
            for a in operands:
                if op.prim == "broadcast_in_dim":
                    dims = [d for i, d in enumerate(op.param("broadcast_dimensions")) if a.shape[i] != 1]
                elif len(a.shape) == len(out.shape):
                    dims = [i for i, d in enumerate(a.shape) if d != 1]
                else:
                    continue
                hints.setdefault(a.id, ROW if all(d < j for d in dims) else COL)
        elif (opdefs.is_layout(op) or op.prim in opdefs.ELEMENTWISE) and out.id in hints:
            for a in operands:
                if a.size == out.size:
                    hints.setdefault(a.id, hints[out.id])
    return hints


def _check_broadcast(op: ir.Op, src: Placed, n: int):
    dims = [d for i, d in enumerate(op.param("broadcast_dimensions")) if src.value.shape[i] != 1]
    _check_spread(src, dims, op.outputs[0], n, op)


def _check_spread(src: Placed, dims, out: ir.Value, n: int, op: ir.Op):
    """A row value must vary only along the row axes of the full value it spreads over (`dims`, the
    output axes its non-unit axes land on), a column value only along the column axes: a value the
    size of the rows that varies along both (a (1, 1, S, S) dropout mask over (B, H, S, S) when
    B*H*S == S*S, say) is neither."""
    j = row_axes(out.shape, n)
    if src.declared == ROW and not all(d < j for d in dims):
        raise Unplannable(ReasonKind.LAYOUT,
                          f"broadcast of a row value {src.value.shape} into columns {out.shape}", op=op)
    if src.declared == COL and not all(d >= j for d in dims):
        raise Unplannable(ReasonKind.LAYOUT,
                          f"broadcast of a column value {src.value.shape} into rows {out.shape}", op=op)


def _place_iota(op: ir.Op, n: int, c: int) -> Placed:
    out = op.outputs[0]
    decl = _declared(out, n, c, COL, op=op)
    shape, dim = out.shape, op.param("dimension")
    if decl == FULL:
        j = row_axes(shape, n)
        part = shape[j:] if dim >= j else shape[:j]
        local = dim - j if dim >= j else dim
        storage = COL if dim >= j else ROW
    else:
        part, local, storage = shape, dim, decl
    stride = math.prod(part[local + 1:])
    return Placed(out, decl, storage, 0, (stride, shape[dim]))


def _place_reduction(op: ir.Op, out: ir.Value, operands: list[Placed], n: int, c: int) -> Placed:
    """`out` (one of op's outputs) from the placed reduced operands (several for a variadic reduce)."""
    src = max(operands, key=lambda p: p.level)
    kind = opdefs.reduce_kind(op)
    if kind == "row":
        for p in operands:
            if p.declared != FULL:
                raise Unplannable(ReasonKind.LAYOUT, f"{op.prim} reduces a {p.declared} value over part of it", op=op)
        return Placed(out, _declared(out, n, c, ROW, op=op), ROW, src.level + 1)
    if kind == "grid":
        if src.level == EPILOGUE:
            raise Unplannable(ReasonKind.LAYOUT, "a grid-wide reduction of a value that is itself grid-reduced", op=op)
        if src.declared == COL:
            raise Unplannable(ReasonKind.LAYOUT, "a reduction of a column value", op=op)
        decl = _declared(out, n, c, COL if out.size == c and src.declared == FULL else SCALAR, op=op)
        if decl == ROW:
            raise Unplannable(ReasonKind.LAYOUT, f"{op.prim} over the leading axes of a row value", op=op)
        return Placed(out, decl, decl, EPILOGUE)
    raise Unplannable(ReasonKind.LAYOUT, f"{op.prim} over axes {op.param('axes')}", op=op)
