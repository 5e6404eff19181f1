"""Data-moving ops inside a region: slice, split, pad, concatenate, rev, transpose, dynamic_slice.

A row-space kernel gives each thread its own elements, so an op that reads another element's value
(`x[..., 1:]`) cannot be computed from registers. XLA's loop fusion solves this by computing the
operand again at the element it needs; so do we. `sink` rewrites a region so that every such op is
pushed through the elementwise and layout ops above it, down to the region's inputs, where it
becomes a `gather` op: a load of the input at an affine function of the element's index. Along the
way

- slice, rev, transpose, broadcast_in_dim, dynamic_slice and reshapes compose into one affine map
  (an `Affine`: source index = const + coef . out index + clamped run-time offsets);
- concatenate and pad become selects on the output coordinate over operands read through shifted
  maps whose indices may fall outside their source ("don't care": clamped, then discarded);
- a reduced value read through a map that only broadcasts it stays a register (layout ops).

The rewritten region has the same inputs and outputs, so everything around the kernel is unchanged;
only the kernel's planning and codegen see it. Inputs read only through gathers are not part of the
row space (their shape may be anything).
"""
from __future__ import annotations

import dataclasses
import itertools
import math

from ..core import ir
from ..core import ops as opdefs
from ..graph import positions
from ..graph.partition import Region
from .layout import GATHER, ReasonKind, Unplannable, row_space

# GATHER, the op sink makes: outputs[0] = inputs[0] (an input) read through the params' `view`.
# A read whose contiguous output axis strides this far through its source (a transpose of the minor
# axis) would not coalesce: each lane of a warp its own 32-byte sector. Such regions stay with XLA.
MAX_MINOR_STRIDE = 8
NEW = -1  # the index of an op sink makes that computes no traced op (coordinates, selects, gathers)


@dataclasses.dataclass(frozen=True)
class Dyn:
    """A run-time offset: clamp(atom, 0, limit) times `coef` (one entry per source axis)."""

    atom: ir.Value
    limit: int
    coef: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Affine:
    """Where element `i` of a value of `shape` comes from in a source of shape `source`:
    src[e] = const[e] + sum_d coef[e][d] * i[d] + sum of the dynamic offsets. `exact`: every index
    lands inside the source (else it is clamped: the element is a don't-care a select discards)."""

    shape: tuple[int, ...]
    source: tuple[int, ...]
    const: tuple[int, ...]
    coef: tuple[tuple[int, ...], ...]
    dyn: tuple[Dyn, ...] = ()
    exact: bool = True

    @staticmethod
    def identity(shape) -> "Affine":
        n = len(shape)
        return Affine(tuple(shape), tuple(shape), (0,) * n,
                      tuple(tuple(int(e == d) for d in range(n)) for e in range(n)))

    @property
    def is_identity(self) -> bool:
        return self == Affine.identity(self.shape)

    def then(self, step: "Affine") -> "Affine":
        """This map (onto `step.shape`) followed by `step` (from that shape onto its source)."""
        m = step.coef
        rows = range(len(step.source))
        mid = range(len(step.shape))
        const = tuple(step.const[f] + sum(m[f][e] * self.const[e] for e in mid) for f in rows)
        coef = tuple(tuple(sum(m[f][e] * self.coef[e][d] for e in mid) for d in range(len(self.shape)))
                     for f in rows)
        dyn = tuple(Dyn(t.atom, t.limit, tuple(sum(m[f][e] * t.coef[e] for e in mid) for f in rows))
                    for t in self.dyn) + step.dyn
        return Affine(self.shape, step.source, const, coef, dyn, self.exact and step.exact)


@dataclasses.dataclass(frozen=True)
class FlatView:
    """A gather's read of its source's memory: element `i` of `shape` at flat offset
    offset + sum_d strides[d] * i[d] + sum_k clamp(dyn operand k, 0, limit_k) * dyn_strides[k],
    clamped to [0, size) unless `exact`."""

    shape: tuple[int, ...]
    offset: int
    strides: tuple[int, ...]
    size: int
    exact: bool
    dyn_limits: tuple[int, ...] = ()
    dyn_strides: tuple[int, ...] = ()
    # Source axes whose index may leave the source (a concatenation's or pad's operand, `exact`
    # False), each (const, coef over the view's axes, extent): index = const + coef . i. Where
    # such an axis runs along rows only, the kernel loads nothing for rows outside it (the select
    # discards those elements): a concatenation along rows reads each operand's bytes once.
    bounds: tuple[tuple[int, tuple[int, ...], int], ...] = ()


def contiguous_strides(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def merged_axes(dims) -> tuple[tuple[int, int], ...]:
    """(size, stride) axes of a view, row-major, with size-1 axes dropped and each axis merged into
    the one before it where that one's stride is its whole extent: the same addresses for every flat
    index (broadcast axes, stride 0, merge with each other and stay: they set which digit of the
    index the others are)."""
    out: list[tuple[int, int]] = []
    for size, stride in dims:
        if size == 1:
            continue
        if out and out[-1][1] == size * stride:
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((size, stride))
    return tuple(out)


def flat_view(a: Affine) -> FlatView:
    cs = contiguous_strides(a.source)
    src = range(len(a.source))
    strides = tuple(sum(a.coef[e][d] * cs[e] for e in src) for d in range(len(a.shape)))
    offset = sum(a.const[e] * cs[e] for e in src)
    minor = [d for d, n in enumerate(a.shape) if n > 1]
    if minor and abs(strides[minor[-1]]) > MAX_MINOR_STRIDE:
        raise Unplannable(ReasonKind.LAYOUT,
                          f"reading {a.source} as {a.shape} walks its minor axis with stride "
                          f"{strides[minor[-1]]} (a transpose): uncoalesced without shared-memory tiles")
    return FlatView(a.shape, offset, strides, math.prod(a.source), a.exact,
                    tuple(t.limit for t in a.dyn), tuple(sum(t.coef[e] * cs[e] for e in src) for t in a.dyn),
                    () if a.exact else _bounds(a))


def _bounds(a: Affine) -> tuple[tuple[int, tuple[int, ...], int], ...]:
    """FlatView.bounds: the source axes whose index can leave [0, extent) over the view's shape
    (axes with run-time offsets are clamped instead, so left out)."""
    out = []
    for e, extent in enumerate(a.source):
        if any(t.coef[e] for t in a.dyn):
            continue
        coef = a.coef[e]
        lo = a.const[e] + sum(min(0, c * (n - 1)) for c, n in zip(coef, a.shape))
        hi = a.const[e] + sum(max(0, c * (n - 1)) for c, n in zip(coef, a.shape))
        if lo < 0 or hi >= extent:
            out.append((a.const[e], coef, extent))
    return tuple(out)


def _whole(view: FlatView) -> bool:
    """Whether a view reads its whole source in memory order."""
    real = [(n, s) for n, s in zip(view.shape, view.strides) if n > 1]
    return (not view.dyn_strides and view.offset == 0 and math.prod(view.shape) == view.size
            and [s for _, s in real] == list(contiguous_strides([n for n, _ in real])))


def _step(shape_out, shape_in, const, pairs, dyn=(), exact=True) -> Affine:
    """An op's map from its output index to its operand's: `pairs` of (operand axis, output axis, k)."""
    coef = [[0] * len(shape_out) for _ in shape_in]
    for f, d, k in pairs:
        coef[f][d] += k
    return Affine(tuple(shape_out), tuple(shape_in), tuple(const), tuple(map(tuple, coef)), tuple(dyn), exact)


def _reshape_step(out_shape, in_shape) -> Affine | None:
    """A reshape's map when every operand axis is a run of output axes (it only splits axes and
    adds or drops unit ones); None when it merges operand axes (not affine)."""
    out_real = [d for d, n in enumerate(out_shape) if n != 1]
    pairs, at = [], 0
    for f, n in enumerate(in_shape):
        if n == 1:
            continue
        run, prod = [], 1
        while at < len(out_real) and prod < n:
            run.append(out_real[at])
            prod *= out_shape[out_real[at]]
            at += 1
        if prod != n:
            return None
        inner = 1
        for d in reversed(run):
            pairs.append((f, d, inner))
            inner *= out_shape[d]
    return _step(out_shape, in_shape, [0] * len(in_shape), pairs)


def _layout_step(op: ir.Op) -> Affine | None:
    src, out = op.inputs[0], op.outputs[0]
    if op.prim == "broadcast_in_dim":
        dims = op.param("broadcast_dimensions")
        pairs = [(e, dims[e], 1) for e in range(len(src.shape)) if src.shape[e] == out.shape[dims[e]]]
        return _step(out.shape, src.shape, [0] * len(src.shape), pairs)
    return _reshape_step(out.shape, src.shape)


def _moving_step(op: ir.Op, out: ir.Value, dyn_atoms) -> Affine:
    """The affine map of slice, split, rev, transpose and dynamic_slice, from the index of `out` (one
    of op's outputs) to its operand's."""
    src = op.inputs[0]
    n = len(src.shape)
    if op.prim == "split":
        axis = op.param("axis")
        start = sum(o.shape[axis] for o in op.outputs[:op.outputs.index(out)])
        return _translate(out.shape, src.shape, [start if e == axis else 0 for e in range(n)])
    if op.prim == "slice":
        steps = op.param("strides") or (1,) * n
        return _step(out.shape, src.shape, op.param("start_indices"), [(e, e, steps[e]) for e in range(n)])
    if op.prim == "rev":
        dims = set(op.param("dimensions"))
        return _step(out.shape, src.shape, [src.shape[e] - 1 if e in dims else 0 for e in range(n)],
                     [(e, e, -1 if e in dims else 1) for e in range(n)])
    if op.prim == "transpose":
        perm = op.param("permutation")
        return _step(out.shape, src.shape, [0] * n, [(perm[d], d, 1) for d in range(n)])
    if op.prim == "dynamic_slice":
        const, dyn = [0] * n, []
        for e, start in enumerate(op.inputs[1:]):
            limit = src.shape[e] - out.shape[e]
            if isinstance(start, ir.Const):
                const[e] = min(max(int(start.value), 0), limit)
            elif limit > 0:
                dyn.append(Dyn(dyn_atoms(start), limit, tuple(int(f == e) for f in range(n))))
        return _translate(out.shape, src.shape, const, dyn)
    raise Unplannable(ReasonKind.OP, f"{op.prim} has no affine map")


def _translate(shape, source, const, dyn=(), exact=True) -> Affine:
    """Output index plus `const` (and the run-time offsets) on every axis: split, dynamic_slice,
    pad, concatenate's pieces (these two possibly outside the operand: not `exact`)."""
    return _step(shape, source, const, [(e, e, 1) for e in range(len(shape))], dyn, exact)


class _Sinker:
    def __init__(self, region: Region, spread: frozenset[int] = frozenset()):
        self.region = region
        self.spread = spread  # inputs read through stride-0 views where broadcast (_spread_inputs)
        self.producer = {o.id: op for op in region.ops for o in op.outputs}
        ids = [v.id for op in region.ops for v in (*op.inputs, *op.outputs) if isinstance(v, ir.Value)]
        self.fresh = itertools.count(1 + max(ids + [v.id for v in region.inputs], default=0))
        self.rep: dict[int, ir.Atom] = {}
        self.memo: dict[tuple[int, Affine], ir.Atom] = {}
        self.ops: list[ir.Op] = []

    def emit(self, prim: str, inputs, shape, dtype: str, params: dict | None = None, index: int = NEW) -> ir.Value:
        """A new op; `index`: the traced op it computes again at other elements, if any."""
        out = ir.Value(next(self.fresh), tuple(shape), dtype)
        self.ops.append(ir.Op(index, prim, tuple(inputs), (out,), tuple(sorted((params or {}).items()))))
        return out

    def current(self, a: ir.Atom) -> ir.Atom:
        return a if isinstance(a, ir.Const) else self.rep.get(a.id, a)

    def run(self) -> Region:
        for op in self.region.ops:
            try:
                self._take(op)
            except Unplannable as e:  # (named after the op being sunk where the reason names none)
                raise e.about(op)
        for v in self.region.outputs:
            now = self.rep.get(v.id, v)
            if now != v:
                self.ops.append(ir.Op(NEW, "copy", (now,), (v,), ()))
        return dataclasses.replace(self.region, ops=ir.live(self.ops, self.region.outputs))

    def _take(self, op: ir.Op) -> None:
        """One op of the region: a data-moving op becomes its outputs' gathers, a broadcast of a
        spread input a view of it, any other op is kept, reading its operands as they now are."""
        if op.prim in opdefs.VIEWS:
            for o in op.outputs:
                self.rep[o.id] = self.build(o, Affine.identity(o.shape))
            return
        if op.prim == "broadcast_in_dim" and self._spread(op.inputs[0]):
            self.rep[op.outputs[0].id] = self.build(op.inputs[0], _layout_step(op))
            return
        inputs = tuple(self._read(a, op) for a in op.inputs)
        self.ops.append(op if inputs == op.inputs else dataclasses.replace(op, inputs=inputs))

    def _spread(self, a: ir.Atom) -> bool:
        return isinstance(a, ir.Value) and a.id in self.spread

    def _read(self, a: ir.Atom, op: ir.Op) -> ir.Atom:
        """Operand `a` of `op` as the op reads it: a spread input that an elementwise op broadcasts
        along its size-1 axes becomes a stride-0 view of the op's shape."""
        out = op.outputs[0]
        if not (self._spread(a) and op.prim in opdefs.ELEMENTWISE and a.shape != out.shape
                and len(a.shape) == len(out.shape)):
            return self.current(a)
        n = len(a.shape)
        return self.build(a, _step(out.shape, a.shape, [0] * n, [(e, e, 1) for e in range(n) if a.shape[e] == out.shape[e]]))

    # ---- reading a value through a map ---------------------------------------------------------
    def build(self, v: ir.Value, a: Affine) -> ir.Atom:
        """An atom holding `v` read through `a` (a value of shape a.shape)."""
        if a.is_identity and v.id in self.rep:
            return self.rep[v.id]
        key = (v.id, a)
        if key not in self.memo:
            self.memo[key] = self._build(v, a)
        return self.memo[key]

    def _build(self, v: ir.Value, a: Affine) -> ir.Atom:
        op = self.producer.get(v.id)
        if op is None:  # a region input
            return v if a.is_identity else self._gather(v, a)
        if a.is_identity and op.prim not in opdefs.VIEWS:
            return self.current(v)
        if a.source != v.shape:
            return self._in_memory_order(v, a, op)
        if op.prim in opdefs.ELEMENTWISE:
            ins = []
            for x in op.inputs:
                if isinstance(x, ir.Const) or not x.shape:
                    ins.append(self.current(x))
                elif len(x.shape) != len(v.shape):
                    raise Unplannable(ReasonKind.LAYOUT, f"{op.prim} of operands of shapes {x.shape} and {v.shape}")
                else:  # (size-1 axes of an operand broadcast)
                    n = len(x.shape)
                    step = _step(v.shape, x.shape, [0] * n, [(e, e, 1) for e in range(n) if x.shape[e] == v.shape[e]])
                    ins.append(self.build(x, a.then(step)))
            return self.emit(op.prim, ins, a.shape, v.dtype, dict(op.params), index=op.index)
        if opdefs.is_layout(op):
            src = op.inputs[0]
            if isinstance(src, ir.Const):
                return self.emit(op.prim, [src], a.shape, v.dtype, {"shape": a.shape, "broadcast_dimensions": ()})
            step = _layout_step(op)
            if step is None:  # a reshape merging axes: v's elements in memory order, as a.source
                return self.build(src, a)
            return self.build(src, a.then(step))
        if op.prim == "concatenate":
            return self._concatenate(op, a)
        if op.prim == "pad":
            return self._pad(op, a)
        if op.prim in opdefs.VIEWS:
            return self.build(op.inputs[0], a.then(_moving_step(op, v, self.current)))
        if op.prim == "iota":
            return self._convert(self._coordinate(a, op.param("dimension")), v.dtype)
        return self._broadcast(v, a, f"a {op.prim} result")

    def _in_memory_order(self, v: ir.Value, a: Affine, op: ir.Op) -> ir.Atom:
        """`v` read through `a` over its elements in memory order, taken as a value of shape a.source
        (below a reshape that merges axes, where no map onto v's own axes is affine): through
        elementwise ops and reshapes down to an input, whose memory has that order too."""
        if op.prim in opdefs.ELEMENTWISE and all(isinstance(x, ir.Const) or x.shape == v.shape for x in op.inputs):
            ins = [self.current(x) if isinstance(x, ir.Const) else self.build(x, a) for x in op.inputs]
            return self.emit(op.prim, ins, a.shape, v.dtype, dict(op.params), index=op.index)
        if opdefs.is_layout(op) and op.prim != "broadcast_in_dim" and isinstance(op.inputs[0], ir.Value):
            return self.build(op.inputs[0], a)
        raise Unplannable(ReasonKind.LAYOUT,
                          f"a data-moving op reads a {op.prim} result through a reshape {v.shape} -> "
                          f"{a.source} that merges its axes")

    def _gather(self, src: ir.Value, a: Affine) -> ir.Atom:
        """A load of input `src` through `a` (whose source shape may be a reshape of src's); a
        one-element input is broadcast instead."""
        if src.size == 1:
            return self._broadcast(src, a, "an input")
        view = flat_view(a)
        if _whole(view):  # src itself, in another shape: read directly (vector loads, the stash)
            if src.shape == a.shape:
                return src
            return self.emit("reshape", [src], a.shape, src.dtype, {"new_sizes": a.shape, "dimensions": None})
        return self.emit(GATHER, [src, *(t.atom for t in a.dyn)], a.shape, src.dtype, {"view": view})

    def _broadcast(self, v: ir.Value, a: Affine, what: str) -> ir.Atom:
        """`v` (a reduction's or another op's result, held as it is) read through a map that only
        broadcasts it: layout ops, which move no data."""
        real = [e for e, n in enumerate(v.shape) if n != 1]
        dims = []
        for e in range(len(v.shape)):
            nz = [(d, k) for d, k in enumerate(a.coef[e]) if k]
            if e not in real:
                ok = not nz and a.const[e] == 0
            else:
                ok = len(nz) == 1 and nz[0][1] == 1 and a.const[e] == 0 and a.shape[nz[0][0]] == v.shape[e]
                dims.extend(d for d, _ in nz)
            if not ok:
                break
        else:
            if not a.dyn and dims == sorted(set(dims)):  # (every index lands in v: exact)
                x = self.current(v)
                squeezed = tuple(v.shape[e] for e in real)
                if squeezed != v.shape:
                    x = self.emit("reshape", [x], squeezed, v.dtype, {"new_sizes": squeezed, "dimensions": None})
                if squeezed == a.shape:
                    return x
                return self.emit("broadcast_in_dim", [x], a.shape, v.dtype,
                                 {"shape": a.shape, "broadcast_dimensions": tuple(dims), "sharding": None})
        raise Unplannable(ReasonKind.LAYOUT, f"{what} read through a data-moving op that does not just broadcast it")

    # ---- coordinates and selects ---------------------------------------------------------------
    def _coordinate(self, a: Affine, axis: int) -> ir.Atom | int:
        """Index `axis` of the source, as an int32 value over a.shape (or an int when constant)."""
        if any(t.coef[axis] for t in a.dyn):
            raise Unplannable(ReasonKind.LAYOUT, "concatenate or pad read at a run-time offset (dynamic_slice of it)")
        total: ir.Atom | None = None
        for d, k in enumerate(a.coef[axis]):
            if not k:
                continue
            term = self.emit("iota", [], a.shape, "int32",
                             {"dtype": "int32", "shape": a.shape, "dimension": d, "sharding": None})
            if k != 1:
                term = self.emit("mul", [term, ir.Const(k, "int32")], a.shape, "int32")
            total = term if total is None else self.emit("add", [total, term], a.shape, "int32")
        if total is None:
            return a.const[axis]
        if a.const[axis]:
            total = self.emit("add", [total, ir.Const(a.const[axis], "int32")], a.shape, "int32")
        return total

    def _convert(self, x: ir.Atom, dtype: str) -> ir.Atom:
        if isinstance(x, int):
            raise Unplannable(ReasonKind.LAYOUT, "an iota read at a constant index")
        return x if dtype == "int32" else self.emit("convert_element_type", [x], x.shape, dtype,
                                                    {"new_dtype": dtype, "weak_type": False})

    def _compare(self, coord, prim: str, bound: int, shape) -> ir.Atom | bool:
        if isinstance(coord, int):
            return {"lt": coord < bound, "ge": coord >= bound}[prim]
        return self.emit(prim, [coord, ir.Const(bound, "int32")], shape, "bool")

    def _select(self, pred, if_false: ir.Atom, if_true: ir.Atom, shape, dtype) -> ir.Atom:
        if isinstance(pred, bool):
            return if_true if pred else if_false
        return self.emit("select_n", [pred, if_false, if_true], shape, dtype)

    def _concatenate(self, op: ir.Op, a: Affine) -> ir.Atom:
        axis, out = op.param("dimension"), op.outputs[0]
        coord = self._coordinate(a, axis)
        starts = list(itertools.accumulate([x.shape[axis] for x in op.inputs], initial=0))
        result = None
        for i in reversed(range(len(op.inputs))):
            shift = [-starts[i] if e == axis else 0 for e in range(len(out.shape))]
            piece = self.build(op.inputs[i], a.then(_translate(out.shape, op.inputs[i].shape, shift, exact=False)))
            if result is None:
                result = piece
            else:
                result = self._select(self._compare(coord, "lt", starts[i + 1], a.shape), result, piece,
                                      a.shape, out.dtype)
        return result

    def _pad(self, op: ir.Op, a: Affine) -> ir.Atom:
        x, fill, out = op.inputs[0], self.current(op.inputs[1]), op.outputs[0]
        config = op.param("padding_config")  # (no interior padding: ops.unsupported_reason)
        tests = []
        for e, (lo, hi, _) in enumerate(config):
            if lo > 0 or hi > 0:
                coord = self._coordinate(a, e)
                if lo > 0:
                    tests.append(self._compare(coord, "ge", lo, a.shape))
                if hi > 0:
                    tests.append(self._compare(coord, "lt", lo + x.shape[e], a.shape))
        filled = self.emit("broadcast_in_dim", [fill], a.shape, out.dtype,
                           {"shape": a.shape, "broadcast_dimensions": (), "sharding": None})
        if False in tests:
            return filled
        crops_only = all(lo <= 0 and hi <= 0 for lo, hi, _ in config)
        inner = self.build(x, a.then(_translate(out.shape, x.shape, [-lo for lo, _, _ in config], exact=crops_only)))
        inside: ir.Atom | bool = True
        for test in tests:
            if test is not True:
                inside = test if inside is True else self.emit("and", [inside, test], a.shape, "bool")
        return self._select(inside, filled, inner, a.shape, out.dtype)


def sink(region: Region) -> Region:
    """The region with every data-moving op pushed down to gathers of its inputs (unchanged when
    it has none), masks computed from positions rebuilt where they are broadcast (positions.py),
    and inputs broadcast over only some row axes read through views; raises
    Unplannable when one cannot be."""
    region = positions.expand(region)
    spread = _spread_inputs(region)
    if not spread and not any(op.prim in opdefs.VIEWS for op in region.ops):
        return region
    return _Sinker(region, spread).run()


def never_placed(region: Region) -> bool:
    """A quick, sound no for `place(sink(region))`, which partitioning asks of thousands of merged
    regions (GPT's step: 1087 merges across views tried, 1037 refused, most of them optimizer
    updates of differently shaped parameters joined through a concatenated weight's slices: its
    partition took 8.7-8.9 s on the CPU machine, 4.6-6.4 s with this). Without reductions or scans
    a row space is the largest value's (layout.row_space), and sinking keeps the region's outputs
    and makes no value of a shape the region did not have but scalars. So where no shape at least
    as large as every output gives a row space that declares all the outputs (each a row, a
    column, a scalar or the whole, and a whole one computed elementwise splits into its rows),
    placing fails."""
    if any(op.prim in opdefs.REDUCTIONS or op.prim in opdefs.SCANS for op in region.ops):
        return False
    sizes = {v.size for v in region.outputs}
    floor = max(sizes, default=0)
    shapes = _row_spaces((v.shape for v in (*region.inputs, *(o for op in region.ops for o in op.outputs))), floor)
    producer = {o.id: op.prim for op in region.ops for o in op.outputs}
    # (placing reads these as rows x columns: elementwise ops, and views sunk into copies)
    by_rows = opdefs.ELEMENTWISE | opdefs.VIEWS | {"broadcast_in_dim"}
    split = [v.shape for v in region.outputs if producer.get(v.id) in by_rows]

    def declares_all(shape) -> bool:
        return _declares(shape, sizes) and all(_splits(s, math.prod(shape[:-1])) for s in split
                                               if math.prod(s) == math.prod(shape))
    return bool(shapes) and not any(declares_all(shape) for shape in shapes)


def refused_union(parts) -> bool:
    """A quick, sound no for planning the union of regions whose ops `parts` (graph.partition.OpsShape)
    describe, without building it: partitioning's merge across views asks it of every pair, and
    GPT's step refused 676 of its 1087 unions here. Where no op reduces or scans and one moves data
    otherwise than by a transpose (which the tile scheme refuses), `never_placed` says no if no
    shape of the union at least as large as every program result it makes declares each of them as
    a row, a column, a scalar or the whole: the program's results are outputs of any region that
    makes them, and only shapes of its values are row spaces."""
    if any(p.reduces for p in parts) or not any(p.moves for p in parts):
        return False
    results = [size for p in parts for size in p.results]
    if not results:
        return False
    shapes = _row_spaces((shape for p in parts for shape in p.shapes), max(results))
    return not any(_declares(shape, results) for shape in shapes)


def _row_spaces(shapes, floor: int) -> set[tuple[int, ...]]:
    """The row spaces placing may take among `shapes`: those of at least `floor` elements (a scalar's
    as (1,)), and a scalar's where `floor` is 1 or less (sinking makes new scalars)."""
    out = {shape or (1,) for shape in shapes if math.prod(shape) >= floor}
    if floor <= 1:
        out.add((1,))
    return out


def _declares(shape: tuple[int, ...], sizes) -> bool:
    """Whether a row space of `shape` declares values of each of `sizes` elements: a row, a column, a
    scalar or the whole."""
    n, c = math.prod(shape[:-1]), shape[-1]
    return all(size in (1, n, c, n * c) for size in sizes)


def _splits(shape: tuple[int, ...], n_rows: int) -> bool:
    """Whether leading axes of `shape` span `n_rows` rows (layout.row_axes does not raise)."""
    return any(math.prod(shape[:j]) == n_rows for j in range(len(shape) + 1))


def _spread_inputs(region: Region) -> frozenset[int]:
    """Inputs that are neither a scalar, a row, a column nor the whole of the row space, and that
    ops broadcast (a (1, 1, q, k) dropout mask of (b, h, q, k) attention weights: it repeats every q
    rows). Registers cannot hold such a value per row or per column; a stride-0 view reads it at
    each element instead, from L1 and L2 (it is small)."""
    try:
        n, c = row_space(region)
    except Unplannable:
        return frozenset()
    odd = {v.id for v in region.inputs if v.size not in (1, n, c, n * c)}
    if not odd:
        return frozenset()

    def spreads(op: ir.Op, a: ir.Value) -> bool:
        return op.prim == "broadcast_in_dim" or (op.prim in opdefs.ELEMENTWISE and a.shape != op.outputs[0].shape)

    return frozenset(a.id for op in region.ops for a in op.inputs
                     if isinstance(a, ir.Value) and a.id in odd and spreads(op, a))
