"""Factors of a region: the loops its dimensions run over, found by unifying dimensions op by op.

Two dimensions get the same factor when one op maps one onto the other element for element (an
elementwise op, the kept axes of a reduction, a broadcast, a transpose). A reshape that merges or
splits dimensions gives the merged dimension the *list* of the finer factors (major first), which is
how Shardy's compound factors describe it. A factor is *pinned* when an op needs it whole on every
device (a slice or a scan along it, a reduction with no collective to complete it): it may not be
sharded. Pure: ir in, a frozen `Factors` out.
"""
from __future__ import annotations

import collections
import dataclasses
import functools

from ...core import ir, ops

# Reductions whose per-shard partials a collective completes (the rest pin their reduced factors).
COLLECTIVE_OF = {"reduce_sum": "psum", "reduce_max": "pmax", "reduce_min": "pmin"}


@dataclasses.dataclass(frozen=True)
class Factors:
    """`dims[value id]` holds, per dimension, its factors (major first; () for a size-1 dim)."""

    sizes: tuple[int, ...]
    dims: tuple[tuple[int, tuple[tuple[int, ...], ...]], ...]
    pinned: frozenset[int]

    def of(self, v: ir.Value) -> tuple[tuple[int, ...], ...]:
        return self._by_id[v.id]

    @functools.cached_property
    def _by_id(self) -> dict:
        return dict(self.dims)


class _Atoms:
    """Union-find over factors, where a factor may be split into finer ones (a reshape's merge)."""

    def __init__(self):
        self.size: list[int] = []
        self.parent: list[int] = []
        self.split: dict[int, list[int]] = {}

    def new(self, n: int) -> int:
        self.size.append(n)
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def find(self, a: int) -> int:
        while self.parent[a] != a:
            self.parent[a] = self.parent[self.parent[a]]
            a = self.parent[a]
        return a

    def flat(self, atoms) -> list[int]:
        out = []
        for a in atoms:
            r = self.find(a)
            out.extend(self.flat(self.split[r]) if r in self.split else [r])
        return out

    def unify(self, xs, ys) -> bool:
        """Make the factor lists `xs` and `ys` (equal products) the same; False if their boundaries
        do not line up (a reshape that moves data between dimensions)."""
        xs, ys = collections.deque(self.flat(xs)), collections.deque(self.flat(ys))
        while xs and ys:
            a, b = self.find(xs[0]), self.find(ys[0])
            if a in self.split or b in self.split:
                for q, r in ((xs, a), (ys, b)):
                    if r in self.split:
                        q.popleft()
                        q.extendleft(reversed(self.flat(self.split[r])))
                continue
            if a == b:
                xs.popleft(), ys.popleft()
            elif self.size[a] == self.size[b]:
                self.parent[b] = a
                xs.popleft(), ys.popleft()
            else:
                big, small, q = (a, b, xs) if self.size[a] > self.size[b] else (b, a, ys)
                if self.size[big] % self.size[small]:
                    return False
                rest = self.new(self.size[big] // self.size[small])
                self.split[big] = [small, rest]
                q.popleft()
                q.extendleft([rest, small])
        return not xs and not ys


def analyze(graph: ir.Graph) -> Factors:
    """The factors of every value of `graph` (a region's ops over its inputs)."""
    atoms = _Atoms()
    dims: dict[int, list[list[int]]] = {}
    pins: list[int] = []

    def of(v):
        if v.id not in dims:
            dims[v.id] = [[atoms.new(d)] if d > 1 else [] for d in v.shape]
        return dims[v.id]

    def same(x, i, y, j):
        if not atoms.unify(of(x)[i], of(y)[j]):
            pin(x, y)

    def pin(*values, axes=None):
        for v in values:
            for i, d in enumerate(of(v)):
                if axes is None or i in axes:
                    pins.extend(d)

    for v in graph.inputs:
        of(v)
    for op in graph.ops:
        _unify_op(op, of, same, pin, atoms)
    return _freeze(atoms, dims, pins)


def _unify_op(op: ir.Op, of, same, pin, atoms: _Atoms) -> None:
    values = [a for a in op.inputs if isinstance(a, ir.Value)]
    out = op.outputs[0]
    for o in op.outputs:
        of(o)
    prim = op.prim
    if not values:  # (an iota, or a broadcast of a literal: fresh factors)
        return
    if prim in ops.ELEMENTWISE:
        for v in values:  # (a size-1 dimension broadcasts: it has no factor)
            if len(v.shape) == len(out.shape):
                for i in range(len(out.shape)):
                    if v.shape[i] == out.shape[i]:
                        same(v, i, out, i)
    elif prim == "broadcast_in_dim":
        x = values[0]
        for i, j in enumerate(op.param("broadcast_dimensions")):
            if x.shape[i] == out.shape[j]:
                same(x, i, out, j)
    elif prim in ("reshape", "squeeze", "expand_dims"):
        if not atoms.unify([a for d in of(values[0]) for a in d], [a for d in of(out) for a in d]):
            pin(values[0], out)
    elif prim == "transpose":
        for i, p in enumerate(op.param("permutation")):
            same(values[0], p, out, i)
    elif prim in ops.REDUCTIONS:
        axes = set(op.param("axes"))
        for x in values[:len(op.outputs)] if prim == ops.VARIADIC else values[:1]:
            kept = [i for i in range(len(x.shape)) if i not in axes]
            for o in op.outputs:
                for j, i in enumerate(kept):
                    same(x, i, o, j)
            if prim not in COLLECTIVE_OF:
                pin(x, axes=axes)
    elif prim in ops.SCANS:
        for i in range(len(out.shape)):
            same(values[0], i, out, i)
        pin(out, axes={op.param("axis")})
    elif prim in ("slice", "pad", "dynamic_slice", "concatenate", "split"):
        _unify_view(op, values, same, pin)
    else:
        pin(*values, *op.outputs)


def _unify_view(op: ir.Op, values, same, pin) -> None:
    """Dimensions a view leaves whole are shared with its result; the others are pinned."""
    prim, x = op.prim, values[0]
    if prim in ("concatenate", "split"):
        axis = op.param("dimension" if prim == "concatenate" else "axis")
        for v in (values if prim == "concatenate" else values[:1]) + list(op.outputs):
            for i in range(len(v.shape)):
                if i != axis:
                    same(v, i, op.outputs[0], i)
            pin(v, axes={axis})
        return
    out = op.outputs[0]
    for i in range(len(x.shape)):
        if prim == "pad":
            whole = tuple(op.param("padding_config")[i]) == (0, 0, 0)
        elif prim == "slice":
            strides = op.param("strides") or (1,) * len(x.shape)
            whole = op.param("start_indices")[i] == 0 and out.shape[i] == x.shape[i] and strides[i] == 1
        else:
            whole = op.param("slice_sizes")[i] == x.shape[i]
        if whole:
            same(x, i, out, i)
        else:
            pin(x, out, axes={i})


def _freeze(atoms: _Atoms, dims, pins) -> Factors:
    flat = {vid: [atoms.flat(d) for d in ds] for vid, ds in dims.items()}
    pinned = set(atoms.flat(pins))
    for ds in flat.values():  # a factor twice in one value (x + x.T) cannot be sharded consistently
        seen = [a for d in ds for a in d]
        pinned.update(a for a in seen if seen.count(a) > 1)
    used = sorted({a for ds in flat.values() for d in ds for a in d})
    index = {a: i for i, a in enumerate(used)}
    return Factors(
        sizes=tuple(atoms.size[a] for a in used),
        dims=tuple(sorted((vid, tuple(tuple(index[a] for a in d) for d in ds)) for vid, ds in flat.items())),
        pinned=frozenset(index[a] for a in pinned if a in index),
    )
