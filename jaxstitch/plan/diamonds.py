"""Which row reductions XLA runs in one kernel with the ops that read their result back per element.

XLA's reduction kernels end at the reduction: an op that reads a row's reduced value back at every
element of the row runs in a kernel after it, re-reading the row's inputs, unless XLA's
normalization-diamond rewrite (SoftmaxRewriterTriton) fuses the two. That rewrite takes only a
"diamond": an elementwise binary op whose second operand is the broadcast reduced value and whose
first operand is the reduction's own input, both reached through ops that change no sizes and read
nothing else (unary ops, binary ops with a scalar operand, reshapes), the reduction and broadcast used
once. A softmax forward (`x - max(x)`, `e / sum(e)`) and a layernorm forward are diamonds; a softmax
backward, `y * (dy - sum(dy * y))`, is not (the reduction reads `dy * y`, the subtraction `dy`): XLA
runs it as two kernels, measured on an H100 at 1.6x our one kernel's time (8x12x512x512 float32,
scripts/softmax_probe.py), where the cost model took it for one kernel.

Where this reading of the rule is unsure it counts the reduction as fused, so the estimate stays on
XLA's side: commutative roots are taken with the broadcast on either side, and a reduction over
several trailing axes is matched as one over the last axis (which XLA may first make it).
"""
from __future__ import annotations

from ..core import ir
from ..core import ops as opdefs
from ..graph.partition import Region

_COMMUTATIVE = frozenset({"add", "mul", "max", "min", "and", "or", "eq", "ne"})


def unfused_reductions(region: Region) -> int:
    """Row reductions of `region` whose result XLA reads back per element in a kernel of its own."""
    ops, outputs = _common(region)
    g = _Graph(ops, outputs)
    fused = {id(r) for op in ops for r in g.diamond_reductions(op)}
    return sum(1 for op in ops if opdefs.is_row_reduction(op) and id(op) not in fused and g.broadcast_back(op))


def _common(region: Region) -> tuple[list[ir.Op], list[ir.Value]]:
    """The region's ops with repeats merged, as XLA's common subexpression elimination leaves them
    (jnp computes a layernorm's `x - mean` twice), and its outputs renamed to match."""
    same: dict[int, ir.Value] = {}
    seen: dict = {}
    ops = []
    for op in region.ops:
        op = ir.reading_renamed(op, same)
        key = (op.prim, op.inputs, op.params, tuple((o.shape, o.dtype) for o in op.outputs))
        try:
            first = seen.setdefault(key, op)
        except TypeError:  # an unhashable parameter: kept as it is
            first = op
        if first is op:
            ops.append(op)
        else:
            same.update((o.id, f) for o, f in zip(op.outputs, first.outputs))
    return ops, [ir.renamed(v, same) for v in region.outputs]


class _Graph:
    def __init__(self, ops: list[ir.Op], outputs: list[ir.Value]):
        self.producer = {o.id: op for op in ops for o in op.outputs}
        self.users: dict[int, int] = {}
        for op in ops:
            for a in op.inputs:
                if isinstance(a, ir.Value):
                    self.users[a.id] = self.users.get(a.id, 0) + 1
        for v in outputs:  # read outside the region too
            self.users[v.id] = self.users.get(v.id, 0) + 1
        self.readers: dict[int, list[ir.Op]] = {}
        for op in ops:
            for a in op.inputs:
                if isinstance(a, ir.Value):
                    self.readers.setdefault(a.id, []).append(op)

    def _splat(self, a: ir.Atom) -> bool:
        """A scalar: a literal, or a broadcast of a scalar value."""
        if isinstance(a, ir.Const) or a.shape == ():
            return True
        op = self.producer.get(a.id)
        return op is not None and op.prim == "broadcast_in_dim" and (
            isinstance(op.inputs[0], ir.Const) or op.inputs[0].shape == ())

    def _trivial(self, op: ir.Op) -> bool:
        """Changes no sizes and reads nothing of the row but one value (XLA's "trivially fusible")."""
        if len(op.outputs) != 1 or self.users.get(op.outputs[0].id, 0) > 1:
            return False
        if op.prim in opdefs.LAYOUT:
            return _bitcast(op)
        if op.prim in opdefs.UNARY or op.prim == "convert_element_type":
            return True
        if op.prim in opdefs.BINARY and len(op.inputs) == 2:
            a, b = op.inputs
            return a == b or (self._splat(a) != self._splat(b))
        return False

    def _operand(self, op: ir.Op) -> ir.Atom:
        return op.inputs[1] if len(op.inputs) == 2 and self._splat(op.inputs[0]) else op.inputs[0]

    def _up_to(self, a: ir.Atom, wanted) -> ir.Op | None:
        """The first op above `a` that `wanted` accepts, through trivial ops only."""
        while isinstance(a, ir.Value) and a.id in self.producer:
            op = self.producer[a.id]
            if wanted(op):
                return op
            if not self._trivial(op):
                return None
            a = self._operand(op)
        return None

    def _spread(self, a: ir.Atom, size: int) -> ir.Value | None:
        """The value `a` broadcasts over rows of `size` elements in all, through trivial ops: the
        input of an explicit broadcast, or a smaller value the reading op broadcasts itself; the
        broadcast read once."""
        while isinstance(a, ir.Value):
            if a.size < size:
                return a if self.users.get(a.id, 0) == 1 else None
            op = self.producer.get(a.id)
            if op is not None and _widening(op):
                return op.inputs[0] if self.users.get(a.id, 0) == 1 else None
            if op is None or not self._trivial(op):
                return None
            a = self._operand(op)
        return None

    def diamond_reductions(self, root: ir.Op) -> list[ir.Op]:
        """The row reductions `root` closes a diamond over (at most one a side)."""
        if root.prim not in opdefs.BINARY or len(root.inputs) != 2:
            return []
        if not all(isinstance(a, ir.Value) for a in root.inputs):
            return []
        sides = [(root.inputs[0], root.inputs[1])]
        if root.prim in _COMMUTATIVE:
            sides.append((root.inputs[1], root.inputs[0]))
        found = []
        for first, second in sides:
            spread = self._spread(second, root.outputs[0].size)
            red = None if spread is None else self._up_to(spread, opdefs.is_row_reduction)
            if red is None or self.users.get(red.outputs[0].id, 0) != 1:
                continue
            producer = self._producer(red)
            if first == producer or (self.users.get(first.id, 0) == 1
                                     and self._up_to(first, lambda op: producer in op.outputs) is not None):
                found.append(red)
        return found

    def _producer(self, red: ir.Op) -> ir.Atom:
        """What the reduction reads, above the trivial ops in between: the diamond's other tip."""
        a = red.inputs[0]
        while isinstance(a, ir.Value) and a.id in self.producer and self._trivial(self.producer[a.id]):
            a = self._operand(self.producer[a.id])
        return a

    def broadcast_back(self, red: ir.Op) -> bool:
        """Whether the reduction's result reaches an op spreading it over the row (a broadcast, or a
        binary op with a full-size operand), through per-row ops."""
        todo, seen = [red.outputs[0]], set()
        while todo:
            v = todo.pop()
            if v.id in seen:
                continue
            seen.add(v.id)
            for op in self.readers.get(v.id, ()):
                if any(o.size > v.size for o in op.outputs):
                    return True
                if not opdefs.is_row_reduction(op) and not opdefs.is_grid_reduction(op):
                    todo.extend(op.outputs)
        return False


def _widening(op: ir.Op) -> bool:
    """A broadcast that adds elements (a row's value spread over the row), not only unit axes."""
    return (op.prim == "broadcast_in_dim" and isinstance(op.inputs[0], ir.Value)
            and op.outputs[0].size > op.inputs[0].size)


def _bitcast(op: ir.Op) -> bool:
    return not isinstance(op.inputs[0], ir.Value) or op.outputs[0].size == op.inputs[0].size
