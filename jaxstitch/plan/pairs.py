"""Rotated halves read from registers: the pairing of a row's columns in h-wide halves.

A rotary embedding (GPT-NeoX, Llama) builds `concatenate([x1 * c - x2 * s, x2 * c + x1 * s])` from
the two halves of each head; its backward pads and slices the same way. After views.sink every
element reads its partner column (h away in its 2h-wide group) through a gather of its own, and
every element computes both halves' formulas, which a select on the column then picks from: the
kernel is bound by the instructions it issues (the target's calibration.gather_ops_per_sm_us), not by HBM.

With a *paired* mapping (mapping.choose's `pair`), each thread holds a column and its partner (its
vector slots 2i and 2i + 1 are h apart), so

- a gather that reads its source at the partner column of another array of the same source (the
  input itself, or another gather of it) becomes PAIR_SWAP of that array: a register read;
- a compare of the column's coordinate that only tells the two halves apart becomes PAIR_HALF, a
  constant per vector slot, so the select after it is decided when the kernel is compiled and the
  formula of the other half (its gathers too) is dead code.

A gather that matches its base in one half only keeps its load for the other half, through a
select on PAIR_HALF: the result is the same value at every element, only cheaper. Both ops are
defined on columns, whatever the mapping: PAIR_SWAP(a)[c] = a[c + h] in the first half of a group,
a[c - h] in the second; PAIR_HALF[c] = whether c is in the second half (`second`) or the first.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from ..core import ir
from ..graph.partition import Region
from .layout import COL, FULL, GATHER, PAIR_HALF, PAIR_SWAP, Layout, row_axes
from .views import merged_axes

COMPARES = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal}


@dataclasses.dataclass(frozen=True)
class _Read:
    """An array of the kernel that holds `src` read at row part `rows` plus `cols[c]` for column c."""

    value: ir.Value
    src: ir.Value
    rows: tuple[tuple[int, int], ...]
    cols: np.ndarray = dataclasses.field(compare=False)


def pair(region: Region, layout: Layout) -> tuple[Region, int] | None:
    """The region rewritten for the best half width h (PAIR_SWAP and PAIR_HALF ops), and h; None
    where no width turns a compare into a half test. (With half tests alone, the other half's
    formula, gathers included, is still dead code.)"""
    c = layout.n_cols
    best = None
    for h in sorted(_widths(region, layout)):
        if c % (2 * h):
            continue
        swaps, halves = _swaps(region, layout, h), _halves(region, layout, h)
        if halves and (best is None or len(swaps) + len(halves) > best[0]):
            best = (len(swaps) + len(halves), h, swaps, halves)
    if best is None:
        return None
    _, h, swaps, halves = best
    return _rewrite(region, h, swaps, halves), h


def _column_iota(op: ir.Op, layout: Layout) -> tuple[int, int, int] | None:
    """(operand index of the coordinate, its stride, its size) for a compare of a column coordinate
    (an iota held per column) with a literal; else None."""
    if op.prim not in COMPARES or len(op.inputs) != 2:
        return None
    for i, a in enumerate(op.inputs):
        other = op.inputs[1 - i]
        if isinstance(a, ir.Value) and isinstance(other, ir.Const):
            p = layout.of(a)
            if p.iota is not None and p.storage == COL:
                return i, p.iota[0], p.iota[1]
    return None


def _compare_values(op: ir.Op, layout: Layout) -> np.ndarray | None:
    """The compare's result at every column, or None when it is no column test."""
    found = _column_iota(op, layout)
    if found is None:
        return None
    i, stride, size = found
    coord = (np.arange(layout.n_cols) // stride) % size
    k = op.inputs[1 - i].value
    return COMPARES[op.prim](coord, k) if i == 0 else COMPARES[op.prim](k, coord)


def _widths(region: Region, layout: Layout) -> set[int]:
    """Candidate half widths: the first run of each column test."""
    out = set()
    for op in region.ops:
        pred = _compare_values(op, layout)
        if pred is not None:
            changes = np.flatnonzero(pred[1:] != pred[:-1])
            if changes.size:
                out.add(int(changes[0]) + 1)
    return out


def _halves(region: Region, layout: Layout, h: int) -> dict[int, bool]:
    """Compare outputs that are exactly "in the second half" (True) or "in the first" (False)."""
    second = (np.arange(layout.n_cols) // h) % 2 == 1
    out = {}
    for op in region.ops:
        pred = _compare_values(op, layout)
        if pred is not None:
            if np.array_equal(pred, second):
                out[op.outputs[0].id] = True
            elif np.array_equal(pred, ~second):
                out[op.outputs[0].id] = False
    return out


def _reads(region: Region, layout: Layout) -> list[_Read]:
    """The arrays a kernel holds of each source: row inputs and column inputs as loaded, and the
    gathers at fixed offsets (run-time offsets are left alone)."""
    n, c = layout.n_rows, layout.n_cols
    out = []
    for v in region.inputs:
        storage = layout.of(v).storage
        if storage == FULL and v.size == n * c:
            out.append(_Read(v, v, merged_axes([(n, c)]), np.arange(c)))
        elif storage == COL and v.size == c:
            out.append(_Read(v, v, merged_axes([(n, 0)]), np.arange(c)))
    for op in region.ops:
        if op.prim != GATHER or len(op.inputs) != 1:
            continue
        out_v, view = op.outputs[0], op.param("view")
        storage = layout.of(out_v).storage
        if storage not in (FULL, COL):
            continue
        j = row_axes(view.shape, n) if storage == FULL else 0
        dims = list(zip(view.shape, view.strides))
        cols = np.full(c, view.offset, dtype=np.int64)
        rest = np.arange(c)
        for size, stride in reversed(dims[j:]):
            cols += (rest % size) * stride
            rest //= size
        out.append(_Read(out_v, op.inputs[0], merged_axes(dims[:j]), cols))
    return out


def _match(g: _Read, b: _Read, h: int) -> tuple[bool, bool]:
    """Whether `g` equals PAIR_SWAP(b) in the first half of every group, and in the second."""
    if g.src != b.src or g.rows != b.rows:
        return False, False
    col = np.arange(len(g.cols))
    first = (col // h) % 2 == 0
    partner = np.where(first, col + h, col - h)
    same = g.cols == b.cols[partner]
    return bool(same[first].all()), bool(same[~first].all())


def _swaps(region: Region, layout: Layout, h: int) -> dict[int, tuple[ir.Value, bool, bool]]:
    """Gather output id -> (the array it swaps, whether in the first half, in the second). Per
    source, the base is the array that serves the most halves of the others (a source's own loaded
    array first on ties); a base is never itself swapped, so no swap reads another."""
    reads = _reads(region, layout)
    out = {}
    for _, group in itertools.groupby(sorted(reads, key=lambda r: (r.src.id, r.rows)), key=lambda r: (r.src.id, r.rows)):
        group = list(group)
        gathers = [r for r in group if r.value != r.src]
        best = None
        for b in group:
            served = {g.value.id: (b.value, *_match(g, b, h)) for g in gathers if g is not b}
            served = {k: m for k, m in served.items() if m[1] or m[2]}
            score = (sum(m[1] + m[2] for m in served.values()), b.value == b.src)
            if served and (best is None or score > best[0]):
                best = (score, served)
        if best is not None:
            out.update(best[1])
    return out


def _rewrite(region: Region, h: int, swaps, halves) -> Region:
    ids = [o.id for op in region.ops for o in op.outputs] + [v.id for v in region.inputs]
    fresh = itertools.count(1 + max(ids, default=0))
    ops: list[ir.Op] = []

    def emit(prim, inputs, like: ir.Value, params, out: ir.Value | None = None) -> ir.Value:
        out = out or ir.Value(next(fresh), like.shape, like.dtype)
        ops.append(ir.Op(-1, prim, tuple(inputs), (out,), tuple(sorted(params.items()))))
        return out

    # (bases first: a swap reads its base, which may be a gather further down)
    bases = {b.id for b, _, _ in swaps.values()}
    ordered = [op for op in region.ops if op.outputs[0].id in bases] + \
              [op for op in region.ops if op.outputs[0].id not in bases]
    for op in ordered:
        out = op.outputs[0]
        if out.id in halves:
            emit(PAIR_HALF, (), out, {"h": h, "second": halves[out.id]}, out=out)
        elif out.id in swaps:
            base, first, second = swaps[out.id]
            if first and second:
                emit(PAIR_SWAP, (base,), out, {"h": h}, out=out)
                continue
            swapped = emit(PAIR_SWAP, (base,), out, {"h": h})
            loaded = ir.Value(next(fresh), out.shape, out.dtype)
            ops.append(dataclasses.replace(op, outputs=(loaded,)))
            half = ir.Value(next(fresh), out.shape, "bool")
            emit(PAIR_HALF, (), half, {"h": h, "second": second}, out=half)
            emit("select_n", (half, loaded, swapped), out, {}, out=out)
        else:
            ops.append(op)
    return dataclasses.replace(region, ops=ir.live(ops, region.outputs))

