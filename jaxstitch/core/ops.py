"""Which primitives may live inside a stitched region, and how each relates elements.

Shared by partitioning (what may join a region), planning (what an op does to the row/column space)
and codegen (which has its own table of C expressions, checked against this one by a test).
"""
from __future__ import annotations

from . import ir

UNARY = frozenset({
    "neg", "abs", "sign", "floor", "ceil", "round", "exp", "exp2", "log", "log1p", "expm1", "tanh",
    "logistic", "erf", "erfc", "erf_inv", "sqrt", "rsqrt", "cbrt", "sin", "cos", "tan", "not",
    "is_finite", "integer_pow", "square", "reciprocal", "one_minus_square", "stop_gradient", "copy",
    "copy_p", "convert_element_type", "bitcast_convert_type", "reduce_precision", "real", "imag",
} - {"real", "imag", "reduce_precision"})
BINARY = frozenset({
    "add", "add_any", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2", "nextafter",
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "xor",
    "shift_left", "shift_right_logical", "shift_right_arithmetic",
} - {"nextafter"})
TERNARY = frozenset({"select_n", "clamp"})
ELEMENTWISE = UNARY | BINARY | TERNARY
# Ops that compute nothing: they only say how an operand's elements spread over the output.
LAYOUT = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims"})
SOURCES = frozenset({"iota"})
# Ops that read other elements' values: a kernel computes their operands again where they are read
# (plan/views.py), as XLA's loop fusion does.
VIEWS = frozenset({"slice", "split", "pad", "concatenate", "rev", "transpose", "dynamic_slice"})
# VARIADIC: `lax.reduce` of several operands at once under a combiner of the user's (a value with its
# index, say); its `combiner` param is the body as an ir.Graph over scalars (trace.py).
VARIADIC = "reduce"
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin", VARIADIC})
# Reductions that pick an element (with its index) rather than fold values: their partials cannot
# meet across the blocks of a split row as a float each (mapping.choose's `splittable`).
PICKING = frozenset({"argmax", "argmin", VARIADIC})
# Cumulative reductions along the last axis: each element is the fold of the row up to it (from its
# end, with reverse=True). A kernel walks the row in order.
SCANS = frozenset({"cumsum", "cumprod", "cummax", "cummin"})
EXPENSIVE = frozenset({"exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "erf", "erfc",
                       "erf_inv", "pow", "sin", "cos", "tan", "atan2", "cbrt"})

# Left to XLA on purpose, with the reason the report shows.
COMPUTE_BOUND = frozenset({"dot_general", "conv_general_dilated", "ragged_dot"})
# Control flow stays an XLA loop or branch; its bodies are planned on their own (pipeline.build).
CONTROL_FLOW = frozenset({"scan", "while", "cond"})


def unsupported_reason(op: ir.Op) -> str | None:
    """None if `op` may join a region, else a short reason."""
    prim = op.prim
    if prim in COMPUTE_BOUND:
        return f"{prim} is compute-intensive (left to XLA/cuBLAS)"
    if prim in CONTROL_FLOW:
        return f"{prim} is control flow (its body is planned on its own)"
    if prim not in ELEMENTWISE | LAYOUT | SOURCES | REDUCTIONS | VIEWS | SCANS:
        return f"{prim} is not a stitchable primitive"
    for v in list(op.inputs) + list(op.outputs):
        if v.dtype not in ir.SUPPORTED_DTYPES:
            return f"{prim} has a {v.dtype} operand (stitched dtypes: {', '.join(ir.SUPPORTED_DTYPES)})"
    if any(o.size == 0 for o in op.outputs):
        return f"{prim} has an empty output"
    if any(isinstance(a, ir.Value) and a.size == 0 for a in op.inputs):
        return f"{prim} has an empty operand"
    reason = _integer_reason(op)
    if reason:
        return reason
    if prim == "reshape" and op.param("dimensions") is not None:
        return "reshape with a dimension permutation moves data"
    if prim == "pad" and any(interior for _, _, interior in op.param("padding_config", ())):
        return "pad with interior padding"
    if prim == "dynamic_slice" and any(a.dtype != "int32" for a in op.inputs[1:]):
        return "dynamic_slice with start indices that are not int32"
    if prim in SCANS:
        shape, axis = op.inputs[0].shape, op.param("axis")
        if any(d != 1 for d in shape[axis + 1:]):
            return f"{prim} along axis {axis} of {shape}, not the last (a kernel scans its rows)"
        if op.inputs[0].dtype == "bool":
            return f"{prim} of a bool value"
    if prim in ("argmax", "argmin") and reduce_kind(op) != "row":
        return f"{prim} is stitched only along the last axes"
    if prim == VARIADIC:
        return _variadic_reason(op)
    return None


# uint32 (the random bits of a dropout, prng.py) joins regions through bit operations only.
_UINT32_OK = frozenset({"add", "sub", "mul", "and", "or", "xor", "not", "shift_left", "shift_right_logical",
                        "shift_right_arithmetic", "eq", "ne", "lt", "le", "gt", "ge", "max", "min",
                        "select_n", "convert_element_type", "bitcast_convert_type", "stop_gradient",
                        "copy", "copy_p", "iota"}) | LAYOUT | VIEWS
_WORDS = ("float32", "int32", "uint32")


def _integer_reason(op: ir.Op) -> str | None:
    """Why an op on uint32 values, a shift or a bitcast stays with XLA (None: it may join)."""
    dtypes = {v.dtype for v in list(op.inputs) + list(op.outputs)}
    if "uint32" in dtypes and op.prim not in _UINT32_OK:
        return f"{op.prim} of a uint32 value (stitched: bit operations, comparisons, converts)"
    if op.prim.startswith("shift_") and not dtypes <= {"int32", "uint32"}:
        return f"{op.prim} of a {op.inputs[0].dtype} value"
    if op.prim == "bitcast_convert_type" and not (op.inputs[0].dtype in _WORDS and op.outputs[0].dtype in _WORDS):
        return f"bitcast_convert_type from {op.inputs[0].dtype} to {op.outputs[0].dtype} (stitched: 4-byte words)"
    if (op.prim == "convert_element_type" and op.outputs[0].dtype == "uint32"
            and op.inputs[0].dtype in ir.FLOAT_DTYPES):
        return f"convert_element_type from {op.inputs[0].dtype} to uint32"
    return None


def _variadic_reason(op: ir.Op) -> str | None:
    graph, k = op.param("combiner"), len(op.outputs)
    if graph is None:
        return "reduce whose combiner captures constants"
    bad = sorted({o.prim for o in graph.ops if o.prim not in ELEMENTWISE})
    if bad:
        return f"reduce whose combiner uses {', '.join(bad)} (stitched: elementwise ops)"
    for v in list(graph.inputs) + [o for g in graph.ops for o in g.outputs]:
        if v.dtype not in ir.SUPPORTED_DTYPES:
            return f"reduce whose combiner computes a {v.dtype} value"
    if not all(isinstance(a, ir.Const) for a in op.inputs[k:]):
        return "reduce with initial values computed at run time"
    if reduce_kind(op) != "row":
        return "reduce (variadic) is stitched only along the last axes"
    return None


def reduced_operands(op: ir.Op) -> tuple[ir.Atom, ...]:
    """The reduced operands of a reduction (a variadic reduce's, without its initial values)."""
    return op.inputs[:len(op.outputs)] if op.prim == VARIADIC else op.inputs[:1]


def nonunit_axes(shape) -> tuple[int, ...]:
    return tuple(i for i, d in enumerate(shape) if d != 1)


def reduce_kind(op: ir.Op) -> str:
    """'trivial' (only size-1 axes), 'row' (a proper suffix of the non-unit axes), 'grid' (all of them, or a
    proper prefix: a column reduction), or 'other' (a middle axis: only a tile kernel holds those,
    plan/tile.py)."""
    shape = op.inputs[0].shape
    axes = tuple(sorted(op.param("axes")))
    real = tuple(a for a in axes if shape[a] != 1)
    nonunit = nonunit_axes(shape)
    if not real:
        return "trivial"
    if real == nonunit:
        return "grid"
    if real == nonunit[len(nonunit) - len(real):]:
        return "row"
    if real == nonunit[:len(real)]:
        return "grid"
    return "other"


def is_layout(op: ir.Op) -> bool:
    """Moves no data and computes nothing (a reduction over size-1 axes included)."""
    return op.prim in LAYOUT or (op.prim in ("reduce_sum", "reduce_max", "reduce_min")
                                 and reduce_kind(op) == "trivial")


def is_grid_reduction(op: ir.Op) -> bool:
    return op.prim in REDUCTIONS and reduce_kind(op) == "grid"


def is_row_reduction(op: ir.Op) -> bool:
    """A reduction over each row's columns (neither a layout no-op nor over the whole grid)."""
    return op.prim in REDUCTIONS and not is_layout(op) and not is_grid_reduction(op)
