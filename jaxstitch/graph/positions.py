"""Values computed from element positions alone, rebuilt at the shape they are broadcast to.

A causal mask (`jnp.tril(jnp.ones((s, s), bool))`: iotas compared, selects of constants) broadcast
over the batch and heads of (b, h, q, k) attention scores is a (q, k) value: neither one per row,
one per column, nor the whole row space, so no layout holds it, and the region around it cannot be
planned (GPT's attention was four regions: the scale, the mask, a convert and the softmax, cut
apart from each other). Its elements depend only on their coordinates, so the kernel can compute
each where it is used: the iotas are rebuilt at the broadcast's shape (along the axes the broadcast
maps theirs to), and the ops on them with them. XLA's fusion computes such a mask per element too.
"""
from __future__ import annotations

import dataclasses
import itertools

from ..core import ir
from ..core import ops as opdefs
from .partition import Region

NEW = -1  # the index of an op this rewrite makes (it computes no traced op)


def expand(region: Region) -> Region:
    """The region with every broadcast of a positional value replaced by that value rebuilt at the
    broadcast's shape (unchanged when it has none)."""
    if not any(op.prim == "broadcast_in_dim" and isinstance(op.inputs[0], ir.Value) and len(op.inputs[0].shape) >= 2
               for op in region.ops):
        return region
    rw = _Rebuilder(region)
    ops, changed = [], False
    for op in region.ops:
        if rw.expandable(op):
            rw.rebuild(op.inputs[0], op.outputs[0].shape, op.param("broadcast_dimensions"), out=op.outputs[0])
            ops.extend(rw.made)
            rw.made = []
            changed = True
        else:
            ops.append(op)
    return dataclasses.replace(region, ops=ir.live(ops, region.outputs)) if changed else region


def positional(v: ir.Value, producer: dict, known: dict | None = None) -> bool:
    """Whether `v` is computed (by the ops of `producer`) from iotas and constants alone, through
    elementwise ops on values of its shape, broadcasts of scalars and broadcasts adding axes."""
    known = {} if known is None else known
    if v.id not in known:
        op = producer.get(v.id)
        known[v.id] = op is not None and (
            op.prim == "iota"
            or (op.prim == "broadcast_in_dim"
                and (_of_scalar(op) or (_adds_axes(op) and positional(op.inputs[0], producer, known))))
            or (op.prim in opdefs.ELEMENTWISE and len(op.outputs) == 1
                and all(isinstance(a, ir.Const) or (a.shape == v.shape and positional(a, producer, known))
                        for a in op.inputs)))
    return known[v.id]


def _of_scalar(op: ir.Op) -> bool:
    return isinstance(op.inputs[0], ir.Const) or op.inputs[0].shape == ()


def _adds_axes(op: ir.Op) -> bool:
    """A broadcast_in_dim that only adds axes (no size-1 axis stretched: the operand's iotas would
    then count along it)."""
    src, out = op.inputs[0], op.outputs[0]
    return all(src.shape[i] == out.shape[d] for i, d in enumerate(op.param("broadcast_dimensions")))


def cone(v: ir.Value, producer: dict) -> list[ir.Op]:
    """The ops computing `v`, a positional value, from its iotas and scalar broadcasts up."""
    ops, stack = {}, [v]
    while stack:
        op = producer[stack.pop().id]
        if op.index not in ops:
            ops[op.index] = op
            if op.prim != "iota" and not (op.prim == "broadcast_in_dim" and _of_scalar(op)):
                stack += [a for a in op.inputs if isinstance(a, ir.Value)]
    return sorted(ops.values(), key=lambda op: op.index)


class _Rebuilder:
    def __init__(self, region: Region):
        self.producer = {o.id: op for op in region.ops for o in op.outputs}
        ids = [v.id for op in region.ops for v in (*op.inputs, *op.outputs) if isinstance(v, ir.Value)]
        self.fresh = itertools.count(1 + max(ids + [v.id for v in region.inputs], default=0))
        self.memo: dict[tuple, ir.Value] = {}
        self.made: list[ir.Op] = []
        self.known: dict[int, bool] = {}

    def expandable(self, op: ir.Op) -> bool:
        """A broadcast_in_dim of a positional value of rank >= 2 that adds axes only (no size-1
        axis stretched: the value's iotas would then count along it). A vector's broadcast (a
        one-hot's column iota) is a column of the row space already."""
        if op.prim != "broadcast_in_dim" or not isinstance(op.inputs[0], ir.Value):
            return False
        return len(op.inputs[0].shape) >= 2 and _adds_axes(op) and self.positional(op.inputs[0])

    def positional(self, v: ir.Value) -> bool:
        return positional(v, self.producer, self.known)

    def rebuild(self, v: ir.Value, shape: tuple, dims: tuple, out: ir.Value | None = None) -> ir.Value:
        """`v` at `shape`, its axis i along axis dims[i]; `out`: the value the last op defines."""
        key = (v.id, shape, dims)
        if key in self.memo and out is None:
            return self.memo[key]
        op = self.producer[v.id]
        params = dict(op.params)
        if op.prim == "iota":
            params.update(shape=shape, dimension=dims[op.param("dimension")], sharding=None)
            inputs = op.inputs
        elif op.prim == "broadcast_in_dim" and _of_scalar(op):
            params.update(shape=shape, broadcast_dimensions=(), sharding=None)
            inputs = op.inputs
        elif op.prim == "broadcast_in_dim":  # (adding axes: its operand's axis i goes to dims[bd[i]])
            inner = tuple(dims[d] for d in op.param("broadcast_dimensions"))
            return self.rebuild(op.inputs[0], shape, inner, out)
        else:
            inputs = tuple(a if isinstance(a, ir.Const) else self.rebuild(a, shape, dims) for a in op.inputs)
        new = out if out is not None else ir.Value(next(self.fresh), shape, v.dtype)
        self.made.append(ir.Op(NEW, op.prim, inputs, (new,), tuple(sorted(params.items()))))
        self.memo[key] = new
        return new
