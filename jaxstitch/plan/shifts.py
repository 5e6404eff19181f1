"""Row-constant shifts taken out of row reductions, so that they fold into the row's first pass.

A log-softmax's statistics (the mean and the max of `lp = x - max(x) - log(sum(exp(..)))`, a
language model's per-token entropy-like summaries, a label-smoothed loss) reduce values that need
the row's first reductions: a second pass over every row. Rows that do not fit in shared memory (a
256k vocabulary, 1 MB a row in float32) read it from HBM again. But a shift `c` constant along the
row comes out of the reduction:

    max_j(a_j - c) = max_j(a_j) - c        sum_j(a_j - c) = sum_j(a_j - p) - n (c - p)   (also a_j + c)

with `p` any per-row value known before the pass: the row's first element, loaded once a row. So
the statistics fold into the first pass beside the max and the sum of exponentials. A masked sum
(a picked log-probability: `where(one_hot, lp, 0)` or `one_hot * lp`, summed) is the same with the
count of kept elements for n: `sum_j m_j (a_j - c) = sum_j m_j (a_j - p) - k (c - p)`.

Exactness, per case:
- max: rounding is monotone, so `max_j fl(a_j - c) = fl(max_j a_j - c)` bit for bit. The one
  difference is at `c = -inf` beside a row holding both -inf and a larger value (the two-pass form
  has NaN there, from -inf + inf). So a max shift is taken out only where `c` cannot be -inf beside
  such a row: `c` is the max of the same `a`, or the log of a sum of exp(x - max(x)) (at least 1,
  or NaN). Any other shift stays.
- sum: the rounding differs. Summing `a_j` itself would accumulate the row's offset (logits around
  100: |a_j| ~ 100 where |a_j - c| ~ 10, and a row of -3e38 overflows); the terms `a_j - p` carry
  the row's spread, as the two-pass form's `a_j - c` do, and `c - p` is small where c brings the
  row near zero (a max does). An infinite first element gives p = 0 (the sum then as written:
  inf or NaN where the two-pass one is). Only float32 sums of a region input, or of one converted
  to float32, are rewritten (p is read from memory); half-precision sums keep the two-pass form. A
  masked sum whose mask keeps nothing is 0, as the two-pass form's zeros sum to (c may be infinite
  there); masks are bools only (a float weight of 0 times an infinite shift is NaN in the two-pass
  form).

Row-constant *factors* come out of a sum of exponentials' products the same way:
`sum_j(g_j * c * exp(x_j - max)) = c * sum_j(g_j * exp(x_j - max))`. A softmax backward's
`sum(dy * y)` is `sum(dy * s^-2 * exp(x - max))` as JAX writes it, `s` the row's sum of exponentials
(known only after the max's pass); without the factor it is a weighted online sum
(plan/online.py) folded into that pass. Rounding differs from the traced order by the last bits.

The planner takes the rewritten region only where it saves a pass over the rows (planner.py); the
region's inputs and outputs do not change, and XLA's fallback evaluates the region as traced.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

from ..core import ir
from ..core import ops as opdefs
from ..graph.partition import Region
from .layout import FULL, GATHER, ROW, SCALAR, Layout
from .online import find_online_sums, max_behind
from .views import FlatView

NEW = -1  # the index of an op this rewrite makes (it computes no traced op)
SHIFTS = ("sub", "add")


@dataclasses.dataclass(frozen=True)
class Weight:
    """A masked sum's mask: its operand was `op`, a `select_n(pred, 0, a)` (a where pred holds, in
    either case order) or a product `f32(pred) * a` (a one-hot's: XLA and codegen make it a select),
    with `a` at `index`."""

    op: ir.Op
    index: int


@dataclasses.dataclass(frozen=True)
class Shift:
    """One peeled shift: the reduction's operand was `a op broadcast(c)`; `c` row-shaped."""

    prim: str      # "sub" or "add"
    row: ir.Atom   # c, one value per row (or a scalar)


def pull_out(region: Region, layout: Layout, factors: bool = True) -> tuple[Region, int]:
    """The region with the shifts of its row reductions taken out (and the row factors of its sums
    of exponentials: `factors`), and how many reductions changed (0: the region itself)."""
    rw = _Rewriter(region, layout, factors)
    for op in region.ops:
        rw.visit(op)
    if not rw.changed:
        return region, 0
    ops = ir.live(rw.ops, region.outputs)
    return dataclasses.replace(region, ops=ops), rw.changed


class _Rewriter:
    def __init__(self, region: Region, layout: Layout, factors: bool = True):
        self.region, self.layout, self.factors = region, layout, factors
        ids = [o.id for op in region.ops for o in op.outputs] + [v.id for v in region.inputs]
        self.fresh = itertools.count(1 + max(ids, default=0))
        self.producer = {o.id: op for op in region.ops for o in op.outputs}
        pairs = find_online_sums(region.ops)
        self.sums_of_exp = {o.sum_id for o in pairs}
        self.online_exps = {o.exp_id for o in pairs}
        self.reductions: dict[tuple, ir.Value] = {}  # (prim, operand, axes) -> an existing output
        self.pilots: dict[int, tuple[ir.Value, ir.Value]] = {}  # src -> its rows' first elements
        self.row_values: dict[tuple, ir.Value] = {}  # (value, shape) -> the value reshaped
        self.ops: list[ir.Op] = []
        self.changed = 0

    def emit(self, prim: str, inputs, like: ir.Value, params: dict | None = None, shape=None,
             out: ir.Value | None = None, dtype: str | None = None) -> ir.Value:
        """A new op; `out`: the value it defines, when it takes over an existing one's definition."""
        if out is None:
            out = ir.Value(next(self.fresh), tuple(like.shape if shape is None else shape), dtype or like.dtype)
        self.ops.append(ir.Op(NEW, prim, tuple(inputs), (out,), tuple(sorted((params or {}).items()))))
        return out

    def visit(self, op: ir.Op):
        if opdefs.is_row_reduction(op) and op.prim in ("reduce_sum", "reduce_max"):
            weight, src, shifts = None, *self._peel(op, op.inputs[0])
            if not shifts and op.prim == "reduce_sum":
                weight, src, shifts = self._weighted(op)
            # (a sum's pilot is read from memory: only a sum of a region input is rewritten)
            if shifts and (op.prim == "reduce_max" or self._loaded(src) is not None):
                self._rewrite(op, src, shifts, weight)
                return
        if self.factors and opdefs.is_row_reduction(op) and op.prim == "reduce_sum" \
                and isinstance(op.inputs[0], ir.Value) and op.outputs[0].dtype == "float32":
            # (float32 sums only: a half-precision sum rounds each term, and the taken-out factor
            # would round otherwise; plan/online.py does not weigh them either)
            fulls, rows = self._factors(op.inputs[0], op.outputs[0])
            if rows and sum(v.id in self.online_exps for v in fulls) == 1:
                self._rewrite_scaled(op, fulls, rows)
                return
        if opdefs.is_row_reduction(op) and len(op.outputs) == 1:
            self.reductions.setdefault(self._key(op.prim, op.inputs[0], op), op.outputs[0])
        self.ops.append(op)

    @staticmethod
    def _key(prim: str, operand: ir.Atom, op: ir.Op) -> tuple:
        return prim, operand, tuple(sorted(op.param("axes")))

    def _weighted(self, op: ir.Op) -> tuple[Weight | None, ir.Atom, list[Shift]]:
        """For a sum of `select_n(pred, 0, a)` or `w * a` with `a` shifted: the weighting, and `a`
        under its shifts (no shifts: nothing found)."""
        d = self.producer.get(op.inputs[0].id) if isinstance(op.inputs[0], ir.Value) else None
        found = []
        if d is not None and d.prim == "select_n" and len(d.inputs) == 3:
            found = [(Weight(d, i), d.inputs[i]) for i in (1, 2) if self._zero(d.inputs[3 - i])]
        elif d is not None and d.prim == "mul" and all(self._full(a) for a in d.inputs):
            found = [(Weight(d, i), d.inputs[i]) for i in (0, 1) if self._of_bool(d.inputs[1 - i])]
        for weight, a in found:
            src, shifts = self._peel(op, a)
            if shifts:
                return weight, src, shifts
        return None, op.inputs[0], []

    def _of_bool(self, a: ir.Value) -> bool:
        """Whether `a` converts a bool value (a one-hot: 0 or 1)."""
        op = self.producer.get(a.id)
        return op is not None and op.prim == "convert_element_type" and op.inputs[0].dtype == "bool"

    def _zero(self, a: ir.Atom) -> bool:
        """Whether `a` is 0 (a literal, or one broadcast or converted)."""
        while isinstance(a, ir.Value):
            op = self.producer.get(a.id)
            if op is None or not (opdefs.is_layout(op) or op.prim == "convert_element_type"):
                return False
            a = op.inputs[0]
        return a.value == 0

    def _peel(self, op: ir.Op, v: ir.Atom) -> tuple[ir.Value, list[Shift]]:
        """The value `v` (what reduction `op` reduces) under its row-constant shifts (outermost
        first), as far as they may go."""
        shifts = []
        out = op.outputs[0]
        if not isinstance(v, ir.Value) or v.dtype not in ir.FLOAT_DTYPES:
            return v, []
        if op.prim == "reduce_sum" and out.dtype != "float32":
            return v, []
        while True:
            d = self.producer.get(v.id)
            if d is None or d.prim not in SHIFTS or d.prim == "add" and op.prim == "reduce_max":
                break
            a, b = d.inputs
            if d.prim == "add" and not self._full(a) and self._full(b):
                a, b = b, a
            if not (isinstance(a, ir.Value) and self._full(a)):
                break
            if op.prim == "reduce_max" and not self._never_neg_inf(b, a):
                break
            row = self._row_source(b, out)
            if row is None:
                break
            shifts.append(Shift(d.prim, row))
            v = a
        return v, shifts

    def _full(self, a: ir.Atom) -> bool:
        return isinstance(a, ir.Value) and self.layout.of(a).storage == FULL

    def _row_source(self, b: ir.Atom, out: ir.Value) -> ir.Atom | None:
        """`b` (a broadcast of one value per row) as a value of `out`'s shape, or None."""
        if isinstance(b, ir.Const):
            return b
        if self.layout.of(b).storage not in (ROW, SCALAR):
            return None
        v = b
        while v.size not in (1, out.size):
            op = self.producer.get(v.id)
            if op is None or not opdefs.is_layout(op) or not isinstance(op.inputs[0], ir.Value):
                return None
            v = op.inputs[0]
        key = (v.id, out.shape)
        if key not in self.row_values:
            self.row_values[key] = self._reshaped(v, out)
        return self.row_values[key]

    def _reshaped(self, v: ir.Value, out: ir.Value) -> ir.Value:
        """`v` (one value per row, or one in all) as a value of `out`'s shape."""
        if v.size != out.size and v.size == 1:  # a scalar shift (one for every row)
            if v.shape != ():
                v = self.emit("reshape", (v,), v, {"new_sizes": (), "dimensions": None}, shape=())
            return self.emit("broadcast_in_dim", (v,), out,
                             {"shape": out.shape, "broadcast_dimensions": (), "sharding": None})
        if v.shape != out.shape:
            v = self.emit("reshape", (v,), out, {"new_sizes": out.shape, "dimensions": None})
        return v

    def _never_neg_inf(self, b: ir.Value | ir.Const, a: ir.Value) -> bool:
        """Whether the shift `b` is never -inf beside an `a` row holding a value above -inf: the max
        of the same `a`, the log of a sum of exp(x - max(x)) (>= 1 or NaN), or a finite constant."""
        if isinstance(b, ir.Const):
            return math.isfinite(b.value)
        m = max_behind(b, self.producer)
        if m is not None and m.inputs[0] == a:
            return True
        v = self._behind_identities(b)
        op = self.producer.get(v.id)
        return op is not None and op.prim == "log" and isinstance(op.inputs[0], ir.Value) \
            and self._behind_identities(op.inputs[0]).id in self.sums_of_exp

    def _behind_identities(self, v: ir.Value) -> ir.Value:
        """`v` through the layout ops and stop_gradients that make it from another value."""
        while True:
            op = self.producer.get(v.id)
            if op is None or not (opdefs.is_layout(op) or op.prim == "stop_gradient") \
                    or not isinstance(op.inputs[0], ir.Value):
                return v
            v = op.inputs[0]

    def _loaded(self, src: ir.Value) -> tuple[ir.Value, ir.Op | None] | None:
        """Where a sum's pilot is read from: `src` itself, a region input, or the input that `src`
        converts to float32 (a half-precision log-softmax computes in float32): (input, convert)."""
        if src in self.region.inputs:
            return src, None
        d = self.producer.get(src.id)
        if d is not None and d.prim == "convert_element_type" and d.inputs[0] in self.region.inputs \
                and d.inputs[0].dtype in ir.FLOAT_DTYPES:
            return d.inputs[0], d
        return None

    def _rewrite(self, op: ir.Op, src: ir.Value, shifts: list[Shift], weight: Weight | None = None):
        """reduce(src) then the shifts undone innermost first (the order the region applied them);
        the last op defines the reduction's own output, so its readers (and the region's outputs)
        stay as they are. A sum reduces src - p, p the row's first element (`_pilot`): its terms
        then carry what the two-pass form's do (the row's spread, not its offset), and
        sum(src - C) = sum(src - p) - n (C - p) with C - p computed from the shifts (C - p is small
        where the shifts bring the row near zero, as a max does). A masked sum (`weight`: a select
        or a one-hot product) is sum(m (src - C)) = sum(m (src - p)) - k (C - p), k the elements
        the mask keeps (a pick's 1), and 0 where it keeps none (C may be infinite there)."""
        out = op.outputs[0]
        pilot = self._pilot(src, out, set(op.param("axes"))) if op.prim == "reduce_sum" else None
        # (a max reuses the region's own max of src; a sum of src - p is no sum the region has)
        weighing = None if weight is None else (weight.op.prim, weight.index, _others(weight))
        key = self._key(op.prim if pilot is None else ("sum_less_pilot", weighing), src, op)
        acc = self.reductions.get(key)
        if acc is None:
            operand = src if pilot is None else self.emit("sub", (src, pilot[0]), src)
            if weight is not None:
                operand = self.emit(weight.op.prim, _others(weight, operand), operand, dict(weight.op.params))
            acc = self.emit(op.prim, (operand,), out, dict(op.params))
            self.reductions[key] = acc
        if pilot is None:  # max(src) - c - ...
            for i, s in enumerate(reversed(shifts)):
                acc = self.emit(s.prim, (acc, s.row), out, out=out if i == len(shifts) - 1 else None)
        else:  # sum(src - p) - n ((c1 - p) + c2 ...), a shift `add` counted negative
            n = math.prod(src.shape[a] for a in op.param("axes"))
            total = None
            for s in reversed(shifts):
                if total is None:
                    total = self.emit("sub", (s.row, pilot[1]), out) if s.prim == "sub" else \
                        self.emit("sub", (self.emit("neg", (s.row,), out), pilot[1]), out)
                else:
                    total = self.emit("add" if s.prim == "sub" else "sub", (total, s.row), out)
            if weight is None:
                count = ir.Const(float(n), out.dtype)
            else:  # how many the mask keeps: the sum of f32(pred), or of select_n(pred, 0, 1)
                ones = weight.op.inputs[1 - weight.index] if weight.op.prim == "mul" else self.emit(
                    "select_n", _others(weight, ir.Const(1.0, out.dtype)), weight.op.outputs[0])
                count = self.emit("reduce_sum", (ones,), out, dict(op.params))
            scaled = self.emit("mul", (total, count), out)
            if weight is not None:  # (a row the mask drops whole sums zeros, whatever its shift)
                none = self.emit("eq", (count, ir.Const(0.0, out.dtype)), out, dtype="bool")
                scaled = self.emit("select_n", (none, scaled, ir.Const(0.0, out.dtype)), out)
            self.emit("sub", (acc, scaled), out, out=out)
        self.changed += 1

    def _factors(self, v: ir.Value, out: ir.Value) -> tuple[list[ir.Value], list[tuple[str, ir.Atom]]]:
        """`v` as a product: its full-size factors, and its row-constant ones as ("mul" | "div",
        the value shaped like `out`); ([v], []) where it is no product of that form."""
        d = self.producer.get(v.id)
        if d is None or d.prim not in ("mul", "div") or len(d.inputs) != 2:
            return [v], []
        fulls, rows = [], []
        for x, prim in ((d.inputs[0], "mul"), (d.inputs[1], d.prim)):
            if self._full(x):
                if prim == "div":  # (a full-size divisor stays in the sum)
                    return [v], []
                f, r = self._factors(x, out)
                fulls, rows = fulls + f, rows + r
                continue
            row = self._row_source(x, out) if isinstance(x, ir.Const) or self.layout.of(x).storage in (ROW, SCALAR) else None
            if row is None:
                return [v], []
            rows.append((prim, row))
        return fulls, rows

    def _rewrite_scaled(self, op: ir.Op, fulls: list[ir.Value], rows: list[tuple[str, ir.Atom]]):
        """sum(g * e) for the full-size factors (e an online exponential, g the others' product),
        then times and over the row factors in their order; the last op defines the sum's output."""
        out = op.outputs[0]
        e = next(v for v in fulls if v.id in self.online_exps)
        operand = e
        for g in (v for v in fulls if v is not e):
            operand = self.emit("mul", (g, operand), operand)
        key = self._key("reduce_sum", operand, op)
        acc = self.reductions.get(key)
        if acc is None:
            acc = self.emit("reduce_sum", (operand,), out, dict(op.params))
            self.reductions[key] = acc
        for i, (prim, row) in enumerate(rows):
            acc = self.emit(prim, (acc, row), out, out=out if i == len(rows) - 1 else None)
        self.changed += 1

    def _pilot(self, src: ir.Value, out: ir.Value, axes) -> tuple[ir.Value, ir.Value]:
        """The row's first element (index 0 along the reduced axes) of `src`, a region input: with
        src's rank, to subtract from it, and shaped like `out` (a load at column 0, once a row; a
        computed src's elements exist only in the row's pass)."""
        if src.id not in self.pilots:
            # (over the rows flattened: row r's first element is at r * C, whatever the row count,
            # so a shape family's kernel source does not change with it)
            cols = math.prod(src.shape[a] for a in axes)
            view = FlatView((out.size,), 0, (cols,), src.size, True)
            base, convert = self._loaded(src)
            loaded = self.emit(GATHER, (base,), out, {"view": view}, shape=(out.size,), dtype=base.dtype)
            if convert is not None:
                loaded = self.emit("convert_element_type", (loaded,), out, dict(convert.params), shape=(out.size,))
            if out.shape != (out.size,):
                loaded = self.emit("reshape", (loaded,), out, {"new_sizes": out.shape, "dimensions": None})
            # (an infinite first element would make inf - inf of its row's terms: 0 instead, the
            # sum then as written, which is inf or NaN as the two-pass one is)
            finite = self.emit("is_finite", (loaded,), out, shape=out.shape, dtype="bool")
            row = self.emit("select_n", (finite, ir.Const(0.0, out.dtype), loaded), out)
            keep = tuple(1 if i in axes else d for i, d in enumerate(src.shape))
            first = self.emit("reshape", (row,), out, {"new_sizes": keep, "dimensions": None}, shape=keep)
            self.pilots[src.id] = (first, row)
        return self.pilots[src.id]


def _others(weight: Weight, a: ir.Atom | None = None) -> tuple:
    """The weighting op's inputs, with `a` in the weighted value's place (None: left out)."""
    ins = list(weight.op.inputs)
    ins[weight.index] = a
    return tuple(ins) if a is not None else tuple(x for i, x in enumerate(ins) if i != weight.index)
