"""Row inputs needed only on a prefix of each row: loads skipped under a causal mask.

`jnp.where(causal, scores, -1e9)` reads a score only where the mask holds, k <= q: on the lower
triangle, half of a square attention's scores. A value every use of which passes through such a
select (elementwise ops at the same position on the way, nothing else) is needed on each row's
first q + c + 1 columns alone, so the kernel need not load the rest: its async copies fill them
with zeros instead (cp.async's src-size 0), which the select then discards. GPT's attention
softmax forward reads its scores this way, and its backward (which recomputes the exponentials)
too; the backward's `dp` is also summed over the whole row, so it is read whole.

Only predicates computed from positions in the kernel (graph/positions.py rebuilds the mask there)
of the form k <= q + c count, k the row's (last) axis and q another axis of the value; a
conjunction (a sliding window) counts through such a term, and so does `P ? x : false` (how
`jnp.tril` of ones comes out).
"""
from __future__ import annotations

import dataclasses

from ..core import ir
from ..core import ops as opdefs
from ..graph.partition import Region
from .layout import FULL, Layout

_ALL = "all"  # needed at every element
_COMPARE = {"ge", "gt", "le", "lt"}


@dataclasses.dataclass(frozen=True)
class Prefix:
    """Input `value` is needed at column k of row r only where k <= (r // stride) % size + offset."""

    value: int
    stride: int
    size: int
    offset: int

    def kept(self, n_cols: int) -> float:
        """The share of the input's elements its rows' prefixes hold (q takes each value equally
        often)."""
        held = sum(min(n_cols, max(0, q + self.offset + 1)) for q in range(self.size))
        return held / (self.size * n_cols)


def find_prefixes(region: Region, layout: Layout) -> tuple[Prefix, ...]:
    """The region's full-size inputs that every use reads under one prefix-shaped positional mask."""
    producer = {o.id: op for op in region.ops for o in op.outputs}
    need: dict[int, object] = {v.id: _ALL for v in region.outputs}  # id -> _ALL or the mask (a Value)

    def add(v, cond):
        if isinstance(v, ir.Value):
            old = need.get(v.id)
            need[v.id] = cond if old is None or old == cond else _ALL

    for op in reversed(region.ops):
        conds = [need[o.id] for o in op.outputs if o.id in need]
        if not conds:
            continue
        cond = conds[0] if all(c == conds[0] for c in conds) else _ALL
        shape = op.outputs[0].shape
        if op.prim == "select_n" and len(op.inputs) == 3 and _prefix_of(op.inputs[0], producer, shape):
            add(op.inputs[0], _ALL)
            add(op.inputs[1], _ALL)
            add(op.inputs[2], op.inputs[0] if cond in (_ALL, op.inputs[0]) else _ALL)
        elif op.prim in opdefs.ELEMENTWISE and len(op.outputs) == 1:
            for a in op.inputs:
                add(a, cond if isinstance(a, ir.Value) and a.shape == shape else _ALL)
        else:
            for a in op.inputs:
                add(a, _ALL)
    out = []
    for v in region.inputs:
        mask = need.get(v.id)
        if mask in (None, _ALL) or layout.of(v).storage != FULL or len(v.shape) < 2:
            continue
        if layout.n_cols != v.shape[-1]:
            continue
        form = _prefix_of(mask, producer, v.shape)
        if form is not None:
            q_axis, offset = form
            stride = 1
            for d in v.shape[q_axis + 1:-1]:
                stride *= d
            out.append(Prefix(v.id, stride, v.shape[q_axis], offset))
    return tuple(out)


def _prefix_of(pred: ir.Atom, producer: dict, shape: tuple) -> tuple[int, int] | None:
    """(q axis, c) where the boolean `pred` (of `shape`) implies k <= q + c, k the last axis."""
    if not isinstance(pred, ir.Value) or pred.dtype != "bool" or pred.shape != shape or len(shape) < 2:
        return None
    op = producer.get(pred.id)
    if op is None:
        return None
    if op.prim == "and":
        for a in op.inputs:
            form = _prefix_of(a, producer, shape)
            if form is not None:
                return form
        return None
    if op.prim == "select_n" and len(op.inputs) == 3 and _all_false(op.inputs[1], producer):
        return _prefix_of(op.inputs[0], producer, shape)  # (P ? x : false, as jnp.tril builds a mask)
    if op.prim not in _COMPARE:
        return None
    a, b = (_position(x, producer, shape) for x in op.inputs)
    if a is None or b is None:
        return None
    k = len(shape) - 1
    (a_axis, a_off), (b_axis, b_off) = a, b
    strict = 1 if op.prim in ("gt", "lt") else 0
    if op.prim in ("ge", "gt"):   # a >= b: the k side is b
        (q_axis, q_off), (k_axis, k_off) = a, b
    else:                         # a <= b: the k side is a
        (q_axis, q_off), (k_axis, k_off) = b, a
    if k_axis != k or q_axis == k:
        return None
    return q_axis, q_off - k_off - strict


def _all_false(x: ir.Atom, producer: dict) -> bool:
    if isinstance(x, ir.Const):
        return x.value is False or (not isinstance(x.value, bool) and x.value == 0 and x.dtype == "bool")
    op = producer.get(x.id)
    return op is not None and op.prim == "broadcast_in_dim" and _all_false(op.inputs[0], producer)


def _position(x: ir.Atom, producer: dict, shape: tuple) -> tuple[int, int] | None:
    """(axis, offset) where `x` is an integer iota along `axis` of `shape`, plus a constant."""
    if not isinstance(x, ir.Value) or x.shape != shape:
        return None
    op = producer.get(x.id)
    if op is None:
        return None
    if op.prim == "iota" and x.dtype in ("int32", "int64", "uint32"):
        return op.param("dimension"), 0
    if op.prim in ("add", "sub") and len(op.inputs) == 2:
        a, b = op.inputs
        if isinstance(b, ir.Const) and isinstance(a, ir.Value):
            inner, c = _position(a, producer, shape), _int(b)
            sign = 1 if op.prim == "add" else -1
        elif isinstance(a, ir.Const) and isinstance(b, ir.Value) and op.prim == "add":
            inner, c, sign = _position(b, producer, shape), _int(a), 1
        else:
            return None
        if inner is None or c is None:
            return None
        return inner[0], inner[1] + sign * c
    return None


def _int(c: ir.Const) -> int | None:
    try:
        value = c.value
        return int(value) if float(value) == int(value) else None
    except (TypeError, ValueError, OverflowError):
        return None
