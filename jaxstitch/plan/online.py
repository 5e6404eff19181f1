"""Online softmax: a row's max and its sum of exp(x - max) reduced in the same pass.

A softmax (log-softmax, cross-entropy, logsumexp written out) reduces each row twice: its max, then
the sum of exp(x - max), which needs the finished max, so a second pass over the row after a block-wide
reduction round. Keeping a running max and rescaling the partial sum whenever it grows (Milakov &
Gimelshein, "Online normalizer calculation for softmax", 2018) folds the sum into the max's pass: one
pass and one reduction round fewer. The sum then differs from the two-pass one by rounding only.

A softmax backward also sums `dy * exp(x - max)` over the row (JAX's `sum(dy * y)` once
plan/shifts.py has taken the row's `1 / sum` factor out of it). That sum rescales with the max as
the sum of exponentials does, so it folds into the same pass too (a *weighted* online sum): rows
too long to keep on chip are then read twice, not three times.

This module finds the pattern; the layout gives the sums the max's level, and codegen
(lowering/reductions.py) emits the accumulation.
"""
from __future__ import annotations

import dataclasses
import math

from ..core import ir
from ..core import ops as opdefs

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
# Row ops between the max and the subtraction that leave the max's value as it is.
_IDENTITY = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "stop_gradient"})


@dataclasses.dataclass(frozen=True)
class OnlineSum:
    """reduce_sum(exp(x - m)) with m = reduce_max(x), up to identity ops: value ids of each part."""

    max_id: int    # m, the reduce_max's output
    sum_id: int    # the reduce_sum's output
    source_id: int  # x, the values of the row both reduce
    diff_id: int   # x - m (the sub's output)
    exp_id: int    # exp(x - m) (the exp's output, which the sum reduces)
    weighted: tuple[WeightedSum, ...] = ()  # sums of g * exp(x - m), rescaled with this one
    # The shift is m where m is finite, else 0 (jax.nn.logsumexp's, optax's losses), not m itself:
    # a row whose max is +inf sums to +inf, one of -inf only to 0 (lowering/reductions.py).
    finite_shift: bool = False

    @property
    def sum_ids(self) -> tuple[int, ...]:
        """Every sum folded in the max's pass: the sum of exp(x - m), then the weighted ones."""
        return (self.sum_id,) + tuple(w.sum_id for w in self.weighted)


@dataclasses.dataclass(frozen=True)
class WeightedSum:
    """reduce_sum(g * exp(x - m)) beside an OnlineSum: g is known in the max's pass (it depends on
    no reduction that x does not)."""

    sum_id: int
    weight_id: int  # g


def sum_ids(online: tuple[OnlineSum, ...]) -> frozenset[int]:
    """The outputs of every sum reduced in its max's pass."""
    return frozenset(i for o in online for i in o.sum_ids)


def find_online_sums(ops: tuple[ir.Op, ...]) -> tuple[OnlineSum, ...]:
    """Every reduce_sum of exp(x - max(x)) over the same row, one per reduce_max."""
    producer = {o.id: op for op in ops for o in op.outputs}
    found, paired = [], set()
    for op in ops:
        if op.prim != "reduce_sum" or not opdefs.is_row_reduction(op):
            continue
        e = producer.get(op.inputs[0].id)
        if e is None or e.prim != "exp":
            continue
        d = producer.get(e.inputs[0].id) if isinstance(e.inputs[0], ir.Value) else None
        if d is None or d.prim != "sub" or not all(isinstance(a, ir.Value) for a in d.inputs):
            continue
        x, shift = d.inputs
        r, finite = shift_source(shift, producer)
        if (r is None or r.outputs[0].id in paired or r.inputs[0].id != x.id
                or r.inputs[0].shape != op.inputs[0].shape
                or tuple(sorted(r.param("axes"))) != tuple(sorted(op.param("axes")))
                or any(v.dtype not in FLOAT_DTYPES for v in (x, d.outputs[0], e.outputs[0], op.outputs[0]))):
            continue
        paired.add(r.outputs[0].id)
        found.append(OnlineSum(r.outputs[0].id, op.outputs[0].id, x.id, d.outputs[0].id, e.outputs[0].id,
                               finite_shift=finite))
    # (weighted sums only beside a max that is the shift itself: their -inf and +inf rows differ)
    return tuple(o if o.finite_shift else dataclasses.replace(o, weighted=_weighted_sums(ops, o, producer))
                 for o in found)


def _weighted_sums(ops, pair: OnlineSum, producer: dict) -> tuple[WeightedSum, ...]:
    """The float32 row sums of `g * exp(x - m)` (either order) over pair's row, g a float value
    that depends on no reduction x does not depend on (so it exists in the max's pass) and is not
    the exponential itself (whose square would rescale by the factor squared)."""
    before_x = _reductions_behind(pair.source_id, producer)
    out = []
    for op in ops:
        if op.prim != "reduce_sum" or not opdefs.is_row_reduction(op) or not isinstance(op.inputs[0], ir.Value):
            continue
        m = producer.get(op.inputs[0].id)
        if m is None or m.prim != "mul" or not all(isinstance(a, ir.Value) for a in m.inputs):
            continue
        e_pos = [i for i, a in enumerate(m.inputs) if a.id == pair.exp_id]
        if len(e_pos) != 1:
            continue
        g = m.inputs[1 - e_pos[0]]
        if (g.shape != m.outputs[0].shape or g.dtype not in FLOAT_DTYPES or op.outputs[0].dtype != "float32"
                or tuple(sorted(op.param("axes"))) != tuple(sorted(producer[pair.sum_id].param("axes")))
                or not _reductions_behind(g.id, producer) <= before_x):
            continue
        out.append(WeightedSum(op.outputs[0].id, g.id))
    return tuple(out)


def _reductions_behind(vid: int, producer: dict) -> frozenset[int]:
    """Outputs of the reductions that value `vid` is computed from (itself included)."""
    seen, stack, found = set(), [vid], set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        op = producer.get(v)
        if op is None:
            continue
        if op.prim in opdefs.REDUCTIONS:
            found.add(v)
        stack += [a.id for a in op.inputs if isinstance(a, ir.Value)]
    return frozenset(found)


def shift_source(v: ir.Value, producer: dict) -> tuple[ir.Op | None, bool]:
    """The row reduce_max a softmax's shift `v` comes from, and whether the shift is that max only
    where finite and 0 elsewhere (`where(is_finite(m), m, 0)`, through identity ops on both sides)."""
    r = max_behind(v, producer)
    if r is not None:
        return r, False
    while True:
        op = producer.get(v.id)
        if op is None:
            return None, False
        if op.prim in _IDENTITY or opdefs.is_layout(op):
            if not isinstance(op.inputs[0], ir.Value):
                return None, False
            v = op.inputs[0]
            continue
        break
    if op.prim != "select_n" or len(op.inputs) != 3 or not all(isinstance(a, ir.Value) for a in op.inputs):
        return None, False
    pred, zero, m = op.inputs  # select_n(p, when false, when true)
    test = producer.get(pred.id)
    if test is None or test.prim != "is_finite" or test.inputs[0] != m or not _is_zero(zero, producer):
        return None, False
    r = max_behind(m, producer)
    return (r, True) if r is not None else (None, False)


def _is_zero(v: ir.Value, producer: dict) -> bool:
    """Whether `v` is 0 broadcast (a broadcast of the literal 0)."""
    op = producer.get(v.id)
    return (op is not None and op.prim == "broadcast_in_dim" and isinstance(op.inputs[0], ir.Const)
            and op.inputs[0].value == 0)


def max_behind(v: ir.Value, producer: dict) -> ir.Op | None:
    """The row reduce_max whose value `v` is, through identity ops and max(-inf, .)."""
    while True:
        op = producer.get(v.id)
        if op is None:
            return None
        if op.prim in _IDENTITY or opdefs.is_layout(op):
            nxt = op.inputs[0]
        elif op.prim == "reduce_max":
            return op if opdefs.is_row_reduction(op) else None
        elif op.prim == "max":
            consts = [a for a in op.inputs if isinstance(a, ir.Const)]
            vals = [a for a in op.inputs if isinstance(a, ir.Value)]
            if len(vals) != 1 or len(consts) != 1 or not (math.isinf(consts[0].value) and consts[0].value < 0):
                return None
            nxt = vals[0]
        else:
            return None
        if not isinstance(nxt, ir.Value) or nxt.dtype != v.dtype:
            return None
        v = nxt
