"""The C expression of each stitchable primitive: a table, not a pass (compare tinygrad's renderer).

Every function takes the op and its operands already rendered as C expressions in compute types
(float for every floating dtype, int for int32, unsigned for uint32, bool for bool) and returns one
C expression.
"""
from __future__ import annotations

import math

from ..core import ir
from ..core import ops as opdefs

CTYPE = {"float32": "float", "bfloat16": "float", "float16": "float", "int32": "int", "uint32": "unsigned",
         "bool": "bool"}
STYPE = {"float32": "float", "bfloat16": "js_bf16", "float16": "js_f16", "int32": "int", "uint32": "unsigned",
         "bool": "unsigned char"}


def literal(value, dtype: str) -> str:
    ctype = CTYPE[dtype]
    if ctype == "bool":
        return "true" if value else "false"
    if ctype == "int":
        return f"({int(value)})"
    if ctype == "unsigned":
        return f"({int(value)}u)"
    v = float(value)
    if math.isnan(v):
        return "JS_NAN"
    if math.isinf(v):
        return "JS_INF" if v > 0 else "(-JS_INF)"
    return f"{v!r}f".replace("inf", "INF")


def _float_fn(name):
    return lambda op, a: f"{name}({a[0]})"


def rounded_float(op: ir.Op) -> ir.Atom | None:
    """The float operand of a conversion that rounds it to a half type, else None: a store of the
    result to that type may take the operand itself, since the store rounds it the same way (one
    rounding, not two)."""
    if (op.prim == "convert_element_type" and op.outputs[0].dtype in ir.HALF_DTYPES
            and CTYPE[op.inputs[0].dtype] == "float"):
        return op.inputs[0]
    return None


ROUND = {"bfloat16": "js_round_bf16", "float16": "js_round_f16"}


def layout_root(region):
    """id -> the id layout ops pass its value along from (a kernel keeps such values once, under
    their root)."""
    alias = {op.outputs[0].id: op.inputs[0].id for op in region.ops
             if opdefs.is_layout(op) and isinstance(op.inputs[0], ir.Value)}

    def root(vid):
        while vid in alias:
            vid = alias[vid]
        return vid
    return root


def written_half(region, loaded, root=None) -> dict[int, str]:
    """The half-precision values a kernel computes and also writes (by the root id layout ops
    alias them to), with their dtypes: its own readers must read them rounded, as written. A
    kernel reading the float a neighbour gets rounded breaks identities between them: a softmax's
    row max, written in bfloat16 for its backward, which recomputes the exponentials from it, was
    subtracted unrounded in the forward kernel, so the backward's exponentials no longer added up
    to the sum the forward wrote (an attention block's bfloat16 gradients ended 1.5-5x further from
    float32 than jax.jit's, H100). `loaded`: ids read from memory (rounded already);
    `root`: the kernel's own id -> root id (by default layout_root)."""
    root = root or layout_root(region)
    return {root(o.id): o.dtype for o in region.outputs
            if o.dtype in ROUND and root(o.id) not in loaded}


def as_written(written: dict[int, str], root: int, expr: str) -> str:
    """`expr`, the value kept under `root`, as its kernel writes it: rounded to its half type where
    `written` (written_half) lists it."""
    half = written.get(root)
    return f"{ROUND[half]}({expr})" if half else expr


def _convert(op: ir.Op, a):
    src, dst = op.inputs[0].dtype, op.outputs[0].dtype
    cs, cd = CTYPE[src], CTYPE[dst]
    x = a[0]
    if cd == "float":
        base = x if cs == "float" else f"((float)({x}))"
        if dst == "bfloat16" and src != "bfloat16" and not op.param("keep_float"):  # wide_converts.py
            return f"js_round_bf16({base})"
        if dst == "float16" and src != "float16":
            return f"js_round_f16({base})"
        return base
    if cd == "int":
        return f"js_f2i({x})" if cs == "float" else f"((int)({x}))"
    if cd == "unsigned":  # (not from a float: ops.py)
        return f"((unsigned)({x}))"
    return f"(({x}) != 0)"


_BITCAST = {("float", "int"): "__float_as_int", ("float", "unsigned"): "__float_as_uint",
            ("int", "float"): "__int_as_float", ("unsigned", "float"): "__uint_as_float",
            ("int", "unsigned"): "(unsigned)", ("unsigned", "int"): "(int)"}


def _bitcast(op: ir.Op, a):
    src, dst = CTYPE[op.inputs[0].dtype], CTYPE[op.outputs[0].dtype]
    return a[0] if src == dst else f"{_BITCAST[src, dst]}({a[0]})"


def _integer_pow(op: ir.Op, a):
    y = op.param("y")
    if 0 < y <= 4:
        return "(" + " * ".join([a[0]] * y) + ")"
    return f"js_ipow({a[0]}, {y})"


def _round(op: ir.Op, a):
    method = op.param("rounding_method", 0)
    return f"rintf({a[0]})" if int(method) == 1 else f"roundf({a[0]})"


def _by_ctype(float_expr: str, int_expr: str, bool_expr: str | None = None):
    def render(op: ir.Op, a):
        ctype = CTYPE[op.inputs[0].dtype]
        expr = {"float": float_expr, "int": int_expr, "unsigned": int_expr, "bool": bool_expr or int_expr}[ctype]
        return expr.format(*a)
    return render


def _select_n(op: ir.Op, a):
    pred, cases = a[0], a[1:]
    if len(cases) == 1:
        return cases[0]
    if CTYPE[op.inputs[0].dtype] == "bool":
        return f"(({pred}) ? ({cases[1]}) : ({cases[0]}))"
    expr = cases[-1]
    for i in range(len(cases) - 2, -1, -1):
        expr = f"(({pred}) == {i} ? ({cases[i]}) : {expr})"
    return expr


EXPR = {
    "neg": lambda op, a: f"(-{a[0]})",
    "abs": _by_ctype("fabsf({0})", "abs({0})"),
    "sign": lambda op, a: f"js_sign({a[0]})",
    "floor": _float_fn("floorf"), "ceil": _float_fn("ceilf"), "round": _round,
    "exp": _float_fn("expf"), "exp2": _float_fn("exp2f"), "log": _float_fn("logf"),
    "log1p": _float_fn("log1pf"), "expm1": _float_fn("expm1f"), "tanh": _float_fn("tanhf"),
    "logistic": _float_fn("js_logistic"), "erf": _float_fn("erff"), "erfc": _float_fn("erfcf"),
    "erf_inv": _float_fn("erfinvf"), "sqrt": _float_fn("sqrtf"), "rsqrt": _float_fn("rsqrtf"),
    "cbrt": _float_fn("cbrtf"), "sin": _float_fn("sinf"), "cos": _float_fn("cosf"), "tan": _float_fn("tanf"),
    "not": _by_ctype("(!{0})", "(~{0})", "(!{0})"),
    "is_finite": _float_fn("isfinite"),
    "integer_pow": _integer_pow,
    "square": lambda op, a: f"({a[0]} * {a[0]})",
    "reciprocal": lambda op, a: f"(1.0f / {a[0]})",
    "one_minus_square": lambda op, a: f"(1.0f - {a[0]} * {a[0]})",  # (jax 0.11: tanh's derivative)
    "stop_gradient": lambda op, a: a[0], "copy": lambda op, a: a[0], "copy_p": lambda op, a: a[0],
    "convert_element_type": _convert, "bitcast_convert_type": _bitcast,
    "add": lambda op, a: f"({a[0]} + {a[1]})", "add_any": lambda op, a: f"({a[0]} + {a[1]})",
    "sub": lambda op, a: f"({a[0]} - {a[1]})", "mul": lambda op, a: f"({a[0]} * {a[1]})",
    "div": _by_ctype("js_div({0}, {1})", "js_idiv({0}, {1})"),
    "rem": _by_ctype("fmodf({0}, {1})", "js_irem({0}, {1})"),
    "pow": lambda op, a: f"powf({a[0]}, {a[1]})",
    "max": lambda op, a: f"js_max({a[0]}, {a[1]})", "min": lambda op, a: f"js_min({a[0]}, {a[1]})",
    "atan2": lambda op, a: f"atan2f({a[0]}, {a[1]})",
    "eq": lambda op, a: f"({a[0]} == {a[1]})", "ne": lambda op, a: f"({a[0]} != {a[1]})",
    "lt": lambda op, a: f"({a[0]} < {a[1]})", "le": lambda op, a: f"({a[0]} <= {a[1]})",
    "gt": lambda op, a: f"({a[0]} > {a[1]})", "ge": lambda op, a: f"({a[0]} >= {a[1]})",
    "and": _by_ctype("", "({0} & {1})", "({0} && {1})"),
    "or": _by_ctype("", "({0} | {1})", "({0} || {1})"),
    "xor": _by_ctype("", "({0} ^ {1})", "({0} != {1})"),
    "shift_left": lambda op, a: f"js_shl({a[0]}, {a[1]})",
    "shift_right_logical": lambda op, a: f"js_shrl({a[0]}, {a[1]})",
    "shift_right_arithmetic": lambda op, a: f"js_shra({a[0]}, {a[1]})",
    "select_n": _select_n,
    "clamp": lambda op, a: f"js_min(js_max({a[1]}, {a[0]}), {a[2]})",
}

# Reductions: (combine functor, identity by compute type).
REDUCE = {
    "reduce_sum": ("js_sum_op()", {"float": "0.0f", "int": "0", "bool": "false"}),
    "reduce_max": ("js_max_op()", {"float": "(-JS_INF)", "int": "JS_INT_MIN", "bool": "false"}),
    "reduce_min": ("js_min_op()", {"float": "JS_INF", "int": "JS_INT_MAX", "bool": "true"}),
}
ARG_REDUCE = {"argmax": "true", "argmin": "false"}
# Scans (ops.SCANS): (combine functor, identity by compute type).
SCAN = {
    "cumsum": REDUCE["reduce_sum"],
    "cumprod": ("js_prod_op()", {"float": "1.0f", "int": "1"}),
    "cummax": REDUCE["reduce_max"],
    "cummin": REDUCE["reduce_min"],
}


FAST = {"exp": "js_exp_fast", "erfc": "js_erfc_fast"}


def expression(op: ir.Op, args: list[str], fast_exp: bool = False) -> str:
    """`op`'s C expression; exp and erfc are fast forms where the plan allows them
    (planner.fast_exp). A discrete op reads its half-precision operands rounded (as_stored)."""
    if fast_exp and op.prim in FAST:
        return f"{FAST[op.prim]}({args[0]})"
    if discrete(op):
        args = [as_stored(a, x) for a, x in zip(op.inputs, args)]
    return EXPR[op.prim](op, args)


# Ops whose result jumps where an operand crosses a point: compares, rounding to integers, a sign,
# a test for infinity, conversions to integers and bitcasts.
DISCRETE = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "floor", "ceil", "round", "sign", "is_finite",
                      "bitcast_convert_type"})


def discrete(op: ir.Op) -> bool:
    """Whether `op` observes its operands' exact values rather than moving continuously with them."""
    if op.prim == "convert_element_type":
        return CTYPE[op.outputs[0].dtype] != "float"
    return op.prim in DISCRETE


def as_stored(a: ir.Atom, expr: str) -> str:
    """`expr`, operand `a` in compute type, as its dtype holds it: a half-precision value, which our
    kernels compute in float (excess precision), rounded to it. A discrete op must see what XLA and
    every other kernel see: a bfloat16 softmax's gradient compared each element, unrounded, with the
    column maximum another kernel had stored rounded, found none equal and divided by a count of zero
    (non-finite gradients, H200). Rounding is monotonic, so a maximum of unrounded values, rounded,
    is the maximum of the rounded ones."""
    half = getattr(a, "dtype", None)
    if half not in ROUND or not isinstance(a, ir.Value) or _is_call(expr, ROUND[half]):
        return expr  # (not half precision, a literal, or rounded already: as_written)
    return f"{ROUND[half]}({expr})"


def as_xla_rounds(op: ir.Op, expr: str, shared: frozenset[int]) -> str:
    """`expr`, `op`'s result, rounded to its half-precision type where another kernel computes `op`
    too (Region.shared), as XLA rounds it; else as it is (computed in float). A conversion that
    wide_converts.py keeps in float stays so: XLA keeps it too."""
    half = op.outputs[0].dtype if op.outputs else None
    if op.index not in shared or half not in ROUND or op.param("keep_float") or _is_call(expr, ROUND[half]):
        return expr
    return f"{ROUND[half]}({expr})"


def _is_call(expr: str, fn: str) -> bool:
    """Whether `expr` is one call of `fn` as a whole (not `fn(a) + b`)."""
    if not (expr.startswith(fn + "(") and expr.endswith(")")):
        return False
    depth = 0
    for i, ch in enumerate(expr[len(fn):]):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return i == len(expr) - len(fn) - 1
    return False


def bool_factor(op: ir.Op, producer: dict) -> tuple[int, ir.Value] | None:
    """For `x * convert(pred)` with `pred` a bool value (`producer`: value id -> the op making it):
    the converted operand's position and `pred`. Such a product is rendered `pred ? x : 0`
    (`select_product`), the select XLA's algebraic simplifier makes of it: a one-hot times -inf is
    0 there, not NaN, so in our kernels too."""
    if op.prim != "mul":
        return None
    for i, a in enumerate(op.inputs):
        src = producer.get(a.id) if isinstance(a, ir.Value) else None
        if (src is not None and src.prim == "convert_element_type" and src.inputs[0].dtype == "bool"
                and isinstance(src.inputs[0], ir.Value)):
            return i, src.inputs[0]
    return None


def select_product(pred: str, x: str, ctype: str) -> str:
    return f"(({pred}) ? ({x}) : ({ctype})0)"
