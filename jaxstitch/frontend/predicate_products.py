"""Products with a predicate converted to a number, written as the selects XLA makes of them.

XLA's algebraic simplifier rewrites `x * convert(p)` (p boolean) as `select(p, x, 0)`. The two
differ where `x` is not finite: `inf * 0` is NaN, the select gives 0. The gradient of a maximum is
such a product (`g * (x == max(x))`, divided by the count of maxima): where the maximum is NaN, no
element equals it and `g` is `1 / 0`; jax.jit's gradient is 0 there, a kernel computing the product
as written gave NaN at all 1024 elements of one random program (H200). Rewriting the products before
planning makes every kernel, ours and XLA's, compute the select.

On an H200 (jax 0.11.2) XLA makes the select for float32, bfloat16 and float16 products alike.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from jax import lax

from ..core import ir

DTYPES = frozenset({"float32", "float64", "bfloat16", "float16"})
REPORTED = "products with a converted predicate as selects"  # the report's name for the rewrite


def _predicates(eqns: Sequence) -> dict[int, ir.Value]:
    """Value id -> the boolean it converts, for each conversion of a boolean to a float."""
    return {e.outputs[0].id: e.inputs[0] for e in eqns
            if e.primitive.name == "convert_element_type" and isinstance(e.inputs[0], ir.Value)
            and e.inputs[0].dtype == "bool" and e.outputs[0].dtype in DTYPES}


def as_selects(eqns: Sequence, new_value: Callable[[tuple, str], ir.Value]) -> tuple[list, int]:
    """`eqns` with every `x * convert(p)` (either order, same shapes) written as a broadcast zero and
    `select_n(p, zero, x)`, and how many were rewritten."""
    predicates = _predicates(eqns)
    out, rewritten = [], 0
    for e in eqns:
        pair = _predicate_and_factor(e, predicates)
        if pair is None:
            out.append(e)
            continue
        pred, factor = pair
        result = e.outputs[0]
        zero = new_value(result.shape, result.dtype)
        out.append(dataclasses.replace(
            e, primitive=lax.broadcast_in_dim_p, inputs=(ir.Const(0.0, result.dtype),), outputs=(zero,),
            params={"shape": result.shape, "broadcast_dimensions": (), "sharding": None}))
        out.append(dataclasses.replace(e, primitive=lax.select_n_p, params={}, inputs=(pred, zero, factor)))
        rewritten += 1
    return out, rewritten


def _predicate_and_factor(eqn, predicates: dict) -> tuple[ir.Value, ir.Value] | None:
    """(p, x) where `eqn` is `x * convert(p)` or `convert(p) * x` of one shape, else None."""
    if eqn.primitive.name != "mul" or eqn.outputs[0].dtype not in DTYPES:
        return None
    a, b = eqn.inputs
    if not (isinstance(a, ir.Value) and isinstance(b, ir.Value) and a.shape == b.shape == eqn.outputs[0].shape):
        return None
    if b.id in predicates:
        return predicates[b.id], a
    if a.id in predicates:
        return predicates[a.id], b
    return None
