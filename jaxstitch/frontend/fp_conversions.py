"""Chains of floating-point conversions collapsed, as XLA collapses them on a GPU.

With `xla_allow_excess_precision` (XLA's default), the GPU compiler's `SimplifyFPConversions`
replaces a chain of two or more conversions between floating types by one conversion from the
chain's start: `x.astype(bf16).astype(f32)` is `x` again, unrounded. XLA does this to the whole
program, so every XLA kernel computes with the unrounded `x`. A kernel of ours that honoured the
rounding computed with other values than its XLA neighbours, and where the two meet in an equality
that breaks: the gradient of `max(x.astype(f16).astype(f32), axis=0)` compares each element, rounded
in our kernel, with XLA's maximum of the unrounded ones, finds no element equal, and divides by a
count of zero (65% off in one random program, H200). Rewriting the chains the same way before
planning makes our kernels compute what XLA computes.

Each conversion whose operand is a floating conversion's result takes the chain's first operand
instead (a conversion to the type that operand already has is the identity; XLA drops it). The
inner conversions stay for their other readers and are dropped where nothing reads them.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from ..core import ir

FLOATS = frozenset({"float32", "bfloat16", "float16", "float64", "float8_e4m3fn", "float8_e5m2"})
REPORTED = "floating conversion chains collapsed"  # the report's name for the rewritten equations


def _is_float_convert(eqn) -> bool:
    return (eqn.primitive.name == "convert_element_type" and isinstance(eqn.inputs[0], ir.Value)
            and eqn.outputs[0].dtype in FLOATS)


def collapse(eqns: Sequence) -> tuple[list, int]:
    """`eqns` with every floating conversion that reads another's result reading the chain's start
    (its own `new_dtype` stays), and how many were rewritten."""
    start: dict[int, ir.Atom] = {}  # a floating conversion's result -> the chain's first operand
    out, rewritten = [], 0
    for e in eqns:
        if not _is_float_convert(e):
            out.append(e)
            continue
        src = e.inputs[0]
        origin = start.get(src.id)
        start[e.outputs[0].id] = origin if origin is not None else src
        if origin is None:
            out.append(e)
            continue
        out.append(dataclasses.replace(e, inputs=(origin,) + tuple(e.inputs[1:])))
        rewritten += 1
    return out, rewritten
