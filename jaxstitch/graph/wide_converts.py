"""Conversions to bfloat16 that our kernels need not round (JAXSTITCH_TUNE=wide_converts=1; off by default).

Our kernels compute every floating value in float32 and round a half-precision value where it is
stored; an explicit `convert_element_type` to bfloat16 also rounds where the kernel goes on
computing with it. XLA on a GPU sometimes does not: with `xla_allow_excess_precision` (its
default) `SimplifyFPConversions` removes chains of floating conversions `f32 -> bf16 -> f32`, which
its bfloat16 normalization writes around ops a GPU runs in float32 (a divide, a tanh). On Hopper
bfloat16 add, sub, mul, max, min, exp and compares are native, so a conversion they read stays.

`widen` marks a conversion (param `keep_float`) where every op computing with its result only does
arithmetic on it, possibly through ops that pass values along (views, selects, max/min): its float
is then used unrounded, and stored values still round (cuda_ops.rounded_float; a value the kernel
also writes is read rounded, cuda_ops.written_half). Where a compare, a conversion to an integer,
a bitcast, a floor and the like reads it, directly or through such ops, its rounding stays. Only
bfloat16: float16's narrow range makes its rounding an overflow to infinity as well.

Measured (H100): an attention block's bfloat16 gradients a little nearer float32
(the key bias's, exactly 0: 0.6-1.0 against 0.8-1.5 from it, jax.jit's 2.8-6.7), but the rule
rounds less than XLA does where its ops are native: a DIEN-like tile kernel whose row sum feeds
`exp(s - max(s))` ended 8% of its largest value from jax.jit's. So it is off by default.
"""
from __future__ import annotations

import dataclasses

from ..core import ir
from ..core.ops import COMPUTE_BOUND, LAYOUT, VIEWS
from ..frontend.transposed_products import readers_by_id

KEEP_FLOAT = "keep_float"
REPORTED = "conversions to bfloat16 unrounded"  # the report's name for the marked conversions
# Ops whose result moves continuously with an operand's value: they may read it unrounded.
ARITHMETIC = frozenset({
    "neg", "abs", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "erf", "erfc", "erf_inv",
    "sqrt", "rsqrt", "cbrt", "sin", "cos", "tan", "integer_pow", "square", "reciprocal", "add", "add_any",
    "sub", "mul", "div", "pow", "atan2", "clamp", "reduce_sum", "cumsum", "cumprod",
})
# Ops that pass an operand's values along (or pick among them): whoever reads their result decides.
PASSING = LAYOUT | VIEWS | frozenset({"select_n", "max", "min", "reduce_max", "reduce_min", "cummax",
                                      "cummin", "stop_gradient", "copy", "copy_p"})


def widen(graph: ir.Graph) -> ir.Graph:
    """`graph` with every conversion to bfloat16 whose rounding no discrete op depends on marked
    `keep_float` (cuda_ops renders it without the rounding)."""
    readers = readers_by_id(graph.ops)
    ops = tuple(dataclasses.replace(op, params=op.params + ((KEEP_FLOAT, True),))
                if _rounds(op) and _continuous(op.outputs[0].id, readers) else op
                for op in graph.ops)
    return graph if ops == graph.ops else dataclasses.replace(graph, ops=ops)


def _rounds(op: ir.Op) -> bool:
    return (op.prim == "convert_element_type" and op.outputs[0].dtype == "bfloat16"
            and op.inputs[0].dtype != "bfloat16" and op.inputs[0].dtype != "bool")


def _continuous(value_id: int, readers) -> bool:
    """Whether every op reading `value_id`, and through passing ops every op reading what they
    pass on, computes continuously from it (or runs outside our kernels, reading it stored)."""
    todo, seen = [value_id], set()
    while todo:
        vid = todo.pop()
        if vid in seen:
            continue
        seen.add(vid)
        for op in readers.get(vid, ()):
            if op.prim in ARITHMETIC or op.prim in COMPUTE_BOUND:
                continue
            if op.prim == "convert_element_type" and op.outputs[0].dtype in ir.FLOAT_DTYPES:
                continue
            if op.prim in PASSING and not (op.prim == "select_n" and getattr(op.inputs[0], "id", None) == vid):
                todo.extend(o.id for o in op.outputs)
                continue
            return False
    return True
