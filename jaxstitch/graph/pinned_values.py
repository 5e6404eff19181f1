"""Values a comparison needs bit for bit on both of its sides: computed once, never recomputed.

The gradient of a maximum compares each element with the maximum (`eq(x, max(x))`) and divides by
how many are equal. Where `x` is computed in one kernel and computed again in another (recompute.py
takes cheap chains into the regions that read them), the two copies must agree to the last bit: an
XLA kernel's `log`, or its rounding of a bfloat16 sum, is not ours, and a column whose maximum is
found equal to no element divides by zero. A bfloat16 softmax over columns recomputed `x * log(|x|
+ 1)` in three kernels, one of them XLA's, and 2965 of its gradient's elements came out non-finite
(H200). Here those values are found; recompute.py then reads them as written instead.

A comparison's two operands that share an ancestor computed with rounding (arithmetic, a narrowing
conversion) pin the shared values each operand's own computation starts from. Values computed
without rounding from the program's inputs (views, negation, max and min, selects, widening
conversions) come out the same in every kernel, and stay free to recompute.
"""
from __future__ import annotations

from ..core import ir
from ..core import ops as opdefs

COMPARES = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})
# Ops whose floating result is one of their operands' values (or a value exactly derived from
# one): every kernel computes them to the same bits from the same operands.
EXACT = opdefs.LAYOUT | opdefs.VIEWS | opdefs.SOURCES | COMPARES | frozenset({
    "neg", "abs", "max", "min", "select_n", "clamp", "reduce_max", "reduce_min", "copy", "copy_p",
    "stop_gradient", "sign", "floor", "ceil", "round", "is_finite", "not", "and", "or", "xor",
    "argmax", "argmin",
})
_WIDTH = {"bool": 0, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "float16": 3, "bfloat16": 3,
          "int32": 4, "uint32": 4, "float32": 5, "int64": 6, "float64": 7}


def pinned(graph: ir.Graph) -> frozenset[int]:
    """Ids of the values that must be computed once: the shared ancestors, computed with rounding,
    from which both operands of a comparison are computed."""
    producer = {o.id: op for op in graph.ops for o in op.outputs}
    rounded: dict[int, bool] = {}
    out: set[int] = set()
    for op in graph.ops:
        if op.prim not in COMPARES or not all(isinstance(a, ir.Value) for a in op.inputs):
            continue
        a, b = op.inputs
        up_a, up_b = _ancestors(a, producer), _ancestors(b, producer)
        for vid in _frontier(up_a & up_b, up_a | up_b, {a.id, b.id}, graph.ops):
            if vid in producer and _computed_with_rounding(vid, producer, rounded):
                out.add(vid)
    return frozenset(out)


def _ancestors(v: ir.Value, producer: dict) -> set[int]:
    """`v` and every value it is computed from."""
    seen, stack = set(), [v.id]
    while stack:
        vid = stack.pop()
        if vid in seen:
            continue
        seen.add(vid)
        op = producer.get(vid)
        if op is not None:
            stack += [a.id for a in op.inputs if isinstance(a, ir.Value)]
    return seen


def _frontier(shared: set[int], upstream: set[int], operands: set[int], ops) -> set[int]:
    """The shared values that are an operand, or that an operand's own (unshared) computation
    reads: read by an op upstream of an operand whose result is not shared."""
    if not shared:
        return set()
    front = shared & operands
    for op in ops:
        if any(o.id in upstream and o.id not in shared for o in op.outputs):
            front |= {a.id for a in op.inputs if isinstance(a, ir.Value) and a.id in shared}
    return front


def _computed_with_rounding(vid: int, producer: dict, memo: dict) -> bool:
    """Whether any op in the computation of value `vid` (back to the program's inputs) rounds."""
    stack, order = [vid], []
    while stack:
        v = stack.pop()
        if v in memo or v not in producer:
            continue
        memo[v] = False  # (provisional: a value is visited once)
        order.append(v)
        stack += [a.id for a in producer[v].inputs if isinstance(a, ir.Value)]
    for v in reversed(order):
        op = producer[v]
        memo[v] = _rounds(op) or any(memo.get(a.id, False) for a in op.inputs if isinstance(a, ir.Value))
    return memo.get(vid, False)


def _rounds(op: ir.Op) -> bool:
    """Whether `op`'s result may differ in its last bits between two correct implementations."""
    if op.prim == "convert_element_type":
        src, dst = op.inputs[0], op.outputs[0]
        return getattr(src, "dtype", None) is not None and _WIDTH.get(dst.dtype, 0) < _WIDTH.get(src.dtype, 9)
    return op.prim not in EXACT
