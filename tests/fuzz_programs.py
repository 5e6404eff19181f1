"""Random memory-bound programs of ranks 1-4: the fuzzer's generator, interpreter and checker.

`programs()` is a hypothesis strategy drawing a `FuzzProgram`: plain data (so hypothesis prints and
shrinks a failing one readably) over inputs of one shape, rank 1 to 4 with odd, size-1 and
sometimes size-0 dimensions, in float32, bfloat16, float16, or int32 / uint32. Its steps are what
memory-bound model code is made of: elementwise and compare/select ops, conversions (round trips
too), reductions over any axes with and without keepdims and broadcast back, argmax, iota masks,
cumulative sums and maxima, roll, slice, pad, concatenate, transpose and reshape, and softmax. A
program runs forward, or as `jax.grad` of `sum(outputs * cotangents)` with respect to its floating
inputs. `fuzz_inputs` draws its arguments, with NaN and Inf injected into some.

What the generator avoids, and why: a result that jumps where a value crosses a point (a compare,
an argmax) reads inputs or float32 values only, never a value computed in half precision, whose
last bit XLA's native bfloat16 arithmetic and our float arithmetic may round differently (any
result within one half-precision step of the point could then legitimately differ). Equalities
that the program makes itself (a maximum's gradient) are kept whatever their type: our kernels
guarantee those (pinned_values.py, cuda_ops.as_stored). Values stay bounded (`squash` is applied
before an op whose result could pass MAX_MAG), so float16 never overflows in one implementation and
not in the other.

`check_against_jit(fn, args, got, want, ref)` is the GPU comparison: every element of ours within
a per-dtype tolerance of the float64 reference widened by jax.jit's own distance from it, NaN and
Inf at jax.jit's positions, integers equal.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax import lax

DIMS = (1, 2, 3, 5, 7, 16, 17, 31, 64, 127, 128, 257, 1024, 4097)
MAX_ELEMS = 1 << 18
MAX_MAG = 1e3
FLOATS = ("float32", "bfloat16", "float16")
INTS = ("int32", "uint32")
UNARY = ("neg", "abs", "sin", "cos", "tanh", "logistic", "exp", "log", "sqrt", "rsqrt", "square", "erf", "squash")
BINARY = ("add", "sub", "mul", "div", "max", "min")
INT_BINARY = ("add", "sub", "mul", "max", "min", "and", "or", "xor", "shl", "shr", "rem")
REDUCE = ("sum", "max", "min", "mean")
COMPARE = ("gt", "lt", "ge", "le", "eq", "ne")
_BOUND_AFTER = {"sin": 1.0, "cos": 1.0, "tanh": 1.0, "logistic": 1.0, "erf": 1.0, "squash": 1.0,
                "rsqrt": 1.0, "exp": math.exp(4.0)}
_DT = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16, "int32": jnp.int32,
       "uint32": jnp.uint32, "bool": jnp.bool_}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Value:
    """What the generator knows of a value: its shape, dtype, a bound on its magnitude, and `prec`,
    the coarsest rounding in its computation that two correct implementations may do differently
    (None: exact, computed from the inputs by ops whose result is the same everywhere: views,
    negation, max and min, selects, conversions)."""

    shape: tuple[int, ...]
    dtype: str
    bound: float
    prec: str | None

    @property
    def exact(self) -> bool:
        return self.prec is None


_COARSENESS = {None: 0, "float32": 1, "float16": 2, "bfloat16": 3}


def coarsest(*precs):
    """The coarsest of precisions (dtype names or None; integer dtypes round nothing)."""
    known = [p for p in precs if p in _COARSENESS]
    return max(known, key=_COARSENESS.get) if known else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class FuzzProgram:
    shape: tuple[int, ...]
    inputs: tuple[str, ...]          # dtypes of the arguments, each of `shape`
    steps: tuple[tuple, ...]         # (op, operand indices and params...): value n_inputs + k
    outputs: tuple[int, ...]
    grad: bool
    nan_inf: bool                    # inject NaN and Inf into the float inputs
    lossy: str | None = None         # the coarsest rounding computed values went through (tolerance)

    def __repr__(self):
        lines = [f"FuzzProgram(shape={self.shape}, inputs={self.inputs}, grad={self.grad}, nan_inf={self.nan_inf}, "
                 f"lossy={self.lossy!r})"]
        n = len(self.inputs)
        lines += [f"  v{n + k} = {s[0]}{s[1:]}" for k, s in enumerate(self.steps)]
        lines.append(f"  out {', '.join(f'v{i}' for i in self.outputs)}")
        return "\n".join(lines)

    @property
    def floating(self) -> tuple[int, ...]:
        return tuple(i for i, d in enumerate(self.inputs) if d in FLOATS)

    def forward(self, *args):
        env = list(args)
        for step in self.steps:
            env.append(_apply(step, env))
        outs = tuple(env[i] for i in self.outputs)
        return outs if len(outs) > 1 else outs[0]

    def function(self):
        """The function to stitch: forward, or its gradient with the cotangents as last argument."""
        if not self.grad:
            return _named(lambda *a: self.forward(*a), "fuzz_forward")
        floating = self.floating

        def loss(*a):
            *xs, cts = a
            outs = self.forward(*xs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            terms = [jnp.sum(o.astype(c.dtype) * c) for o, c in zip(outs, cts) if _is_float(o.dtype)]
            return sum(terms) if terms else jnp.zeros((), cts[0].dtype)
        return _named(jax.grad(loss, argnums=floating), "fuzz_gradient")


def _named(fn, name):
    fn.__name__ = fn.__qualname__ = name
    return fn


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


# --------------------------------------------------------------------------------------------------
# The interpreter
# --------------------------------------------------------------------------------------------------

def _unary(kind, v):
    return {
        "neg": lambda: -v, "abs": lambda: jnp.abs(v), "sin": lambda: jnp.sin(v), "cos": lambda: jnp.cos(v),
        "tanh": lambda: jnp.tanh(v), "logistic": lambda: jax.nn.sigmoid(v), "erf": lambda: lax.erf(v),
        "exp": lambda: jnp.exp(v / (1 + jnp.abs(v)) * 4), "log": lambda: jnp.log(jnp.abs(v) + 1),
        "sqrt": lambda: jnp.sqrt(jnp.abs(v)), "rsqrt": lambda: lax.rsqrt(jnp.abs(v) + 1),
        "square": lambda: v * v, "squash": lambda: v / (1 + jnp.abs(v)),
    }[kind]()


def _binary(kind, a, b):
    if kind == "div":
        return a / (1 + jnp.abs(b))
    if kind == "rem":
        return lax.rem(a, (b & 7) + 1) if jnp.issubdtype(b.dtype, jnp.unsignedinteger) else lax.rem(a, jnp.abs(b % 7) + 1)
    if kind in ("shl", "shr"):
        amount = (b & 31).astype(a.dtype)
        return lax.shift_left(a, amount) if kind == "shl" else lax.shift_right_logical(a, amount)
    return {"add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "max": jnp.maximum, "min": jnp.minimum,
            "and": jnp.bitwise_and, "or": jnp.bitwise_or, "xor": jnp.bitwise_xor}[kind](a, b)


def _compare(kind, a, b):
    return {"gt": a > b, "lt": a < b, "ge": a >= b, "le": a <= b, "eq": a == b, "ne": a != b}[kind]


def _reduce(kind, v, axes, keepdims):
    fn = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min, "mean": jnp.mean}[kind]
    return fn(v, axis=axes, keepdims=keepdims)


def _apply(step, env):
    op, *p = step
    if op == "unary":
        return _unary(p[0], env[p[1]])
    if op == "binary":
        return _binary(p[0], env[p[1]], env[p[2]])
    if op == "where":  # (compare kind, a, b or ("const", c), then, else)
        kind, a, b, t, f = p
        rhs = b[1] if isinstance(b, tuple) else env[b]
        return jnp.where(_compare(kind, env[a], rhs), env[t], env[f])
    if op == "convert":
        return env[p[0]].astype(_DT[p[1]])
    if op == "reduce":
        return _reduce(p[0], env[p[1]], p[2], p[3])
    if op == "argmax":
        return jnp.argmax(env[p[0]], axis=p[1]).astype(jnp.float32)
    if op == "mask":  # keep where iota along a >= iota along b (a causal mask), else fill
        v, a, b, fill = p
        x = env[v]
        keep = lax.broadcasted_iota(jnp.int32, x.shape, a) >= lax.broadcasted_iota(jnp.int32, x.shape, b)
        return jnp.where(keep, x, jnp.asarray(fill, x.dtype))
    if op == "scan":
        kind, v, axis, reverse = p
        fn = {"cumsum": lax.cumsum, "cummax": lax.cummax}[kind]
        return fn(env[v], axis=axis, reverse=reverse)
    if op == "roll":
        return jnp.roll(env[p[0]], p[1], p[2])
    if op == "slice":
        v, axis, start, stop = p
        return lax.slice_in_dim(env[v], start, stop, axis=axis)
    if op == "pad":
        v, axis, lo, hi, fill = p
        x = env[v]
        config = [(0, 0, 0)] * x.ndim
        config[axis] = (lo, hi, 0)
        return lax.pad(x, jnp.asarray(fill, x.dtype), config)
    if op == "concat":
        return jnp.concatenate([env[p[0]], env[p[1]]], axis=p[2])
    if op == "transpose":
        return jnp.transpose(env[p[0]], p[1])
    if op == "reshape":
        return env[p[0]].reshape(p[1])
    if op == "softmax":
        return jax.nn.softmax(env[p[0]], axis=p[1])
    raise ValueError(op)


# --------------------------------------------------------------------------------------------------
# The generator
# --------------------------------------------------------------------------------------------------

@st.composite
def shapes(draw, allow_empty: bool = True):
    rank = draw(st.integers(1, 4))
    while True:
        dims = [draw(st.sampled_from(DIMS)) for _ in range(rank)]
        if math.prod(dims) <= MAX_ELEMS:
            break
        rank = max(1, rank - 1)
    if allow_empty and draw(st.integers(0, 29)) == 0:
        dims[draw(st.integers(0, rank - 1))] = 0
    return tuple(dims)


@st.composite
def programs(draw, max_steps: int = 10, allow_empty: bool = True):
    shape = draw(shapes(allow_empty))
    integer = draw(st.integers(0, 9)) == 0
    if integer:
        inputs = tuple(draw(st.sampled_from(INTS)) for _ in range(draw(st.integers(1, 2))))
        inputs = (inputs[0],) * len(inputs)  # (one integer type: no promotion to 64 bits)
    else:
        inputs = tuple(draw(st.sampled_from(FLOATS)) for _ in range(draw(st.integers(1, 3))))
    vals = [Value(shape=shape, dtype=d, bound=4.0 if d in FLOATS else 1000.0, prec=None) for d in inputs]
    steps: list[tuple] = []
    n = len(inputs)
    grad = not integer and draw(st.booleans())
    ctx = Ctx(integer=integer, grad=grad)
    for _ in range(draw(st.integers(1, max_steps))):
        for step, value in _draw_step(draw, vals, ctx):
            steps.append(step)
            if len(vals) < n + len(steps):  # (a squash before the op is in `vals` already)
                vals.append(value)
    last = len(vals) - 1
    extra = draw(st.lists(st.integers(n, last), max_size=2, unique=True)) if last >= n else []
    outputs = tuple(dict.fromkeys([last] + extra))
    grad = grad and any(_is_float(_DT[vals[i].dtype]) for i in outputs)
    nan_inf = not integer and draw(st.integers(0, 3)) == 0
    lossy = coarsest(*(v.prec for v in vals), *(v.dtype for v in vals[n:] if grad))
    return FuzzProgram(shape=shape, inputs=inputs, steps=tuple(steps), outputs=outputs, grad=grad, nan_inf=nan_inf,
                       lossy=lossy)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ctx:
    integer: bool  # an integer program
    grad: bool     # differentiated: ops whose gradient routes by comparisons read discrete operands


def _draw_step(draw, vals: list[Value], ctx: Ctx) -> list[tuple[tuple, Value]]:
    """One op (sometimes with a `squash` before it), as [(step, value)]."""
    integer = ctx.integer
    kinds = ["unary", "binary", "binary", "where", "reduce", "reduce", "scan", "roll", "slice", "pad",
             "concat", "transpose", "reshape", "convert", "mask", "argmax", "softmax"]
    if integer:
        kinds = ["binary", "binary", "where", "reduce", "scan", "roll", "slice", "pad", "concat", "transpose",
                 "reshape", "mask"]
    kind = draw(st.sampled_from(kinds))
    return globals()[f"_step_{kind}"](draw, vals, ctx) or _step_binary(draw, vals, ctx) or []


def _pick(draw, vals: list[Value], ok=lambda v: True) -> int | None:
    cands = [i for i, v in enumerate(vals) if ok(v)]
    return draw(st.sampled_from(cands)) if cands else None


def _squashed(draw, vals, i, new_bound, made) -> int:
    """`i`, or a squashed copy of it where the op after would pass MAX_MAG."""
    v = vals[i]
    if new_bound <= MAX_MAG or v.dtype not in FLOATS:
        return i
    made.append((("unary", "squash", i), dataclasses.replace(v, bound=1.0, prec=coarsest(v.prec, v.dtype))))
    vals.append(made[-1][1])
    return len(vals) - 1


def _float(v: Value) -> bool:
    return v.dtype in FLOATS


def _step_unary(draw, vals, ctx):
    integer = ctx.integer
    i = _pick(draw, vals, _float)
    if i is None:
        return None
    kind = draw(st.sampled_from(UNARY))
    b = vals[i].bound
    bound = _BOUND_AFTER.get(kind, {"log": math.log1p(b), "sqrt": math.sqrt(b), "square": b * b}.get(kind, b))
    made = []
    i = _squashed(draw, vals, i, bound, made)
    if kind == "square" and vals[i].bound == 1.0:
        bound = 1.0
    v = vals[i]
    made.append((("unary", kind, i), Value(shape=v.shape, dtype=v.dtype, bound=min(bound, MAX_MAG),
                                          prec=v.prec if kind in ("neg", "abs") else coarsest(v.prec, v.dtype))))
    return made


def _broadcastable(a: tuple, b: tuple) -> bool:
    if len(a) != len(b):
        return False
    try:
        return np.broadcast_shapes(a, b) in (a, b)
    except ValueError:
        return False


def _result_dtype(a: str, b: str) -> str:
    return jnp.result_type(_DT[a], _DT[b]).name


def _step_binary(draw, vals, ctx):
    integer = ctx.integer
    i = _pick(draw, vals, lambda v: (v.dtype in INTS) == integer and v.dtype != "bool")
    if i is None:
        return None
    j = _pick(draw, vals, lambda v: _broadcastable(v.shape, vals[i].shape) and (v.dtype in INTS) == integer
              and (not integer or v.dtype == vals[i].dtype))
    kind = draw(st.sampled_from(INT_BINARY if integer else BINARY))
    if ctx.grad and kind in ("max", "min") and not (_discrete_operand(vals[i]) and _discrete_operand(vals[j])):
        kind = "add"  # (its gradient picks an operand by comparing them)
    a, b = vals[i], vals[j]
    bound = {"add": a.bound + b.bound, "sub": a.bound + b.bound, "mul": a.bound * b.bound}.get(kind, max(a.bound, b.bound))
    made = []
    if not integer and bound > MAX_MAG:
        i = _squashed(draw, vals, i, bound, made)
        j = _squashed(draw, vals, j, bound, made)
        bound = min(bound, 2.0)
    a, b = vals[i], vals[j]
    shape = np.broadcast_shapes(a.shape, b.shape)
    dtype = _result_dtype(a.dtype, b.dtype)
    # (a division's divisor, 1 + |b|, is computed in b's own dtype: XLA rounds it there, our kernels
    # need not)
    prec = coarsest(a.prec, b.prec) if kind in ("max", "min") else \
        coarsest(a.prec, b.prec, dtype, b.dtype if kind == "div" else None)
    made.append((("binary", kind, i, j), Value(shape=tuple(shape), dtype=dtype,
                                               bound=min(bound, MAX_MAG) if not integer else bound, prec=prec)))
    return made


def _discrete_operand(v: Value) -> bool:
    """A value a compare may read: exact, or rounded in float32 at the coarsest (see the module docstring)."""
    return v.prec in (None, "float32")


def _step_where(draw, vals, ctx):
    integer = ctx.integer
    a = _pick(draw, vals, lambda v: _discrete_operand(v) and (v.dtype in INTS) == integer)
    if a is None:
        return None
    kind = draw(st.sampled_from(COMPARE))
    other = _pick(draw, vals, lambda v: v.shape == vals[a].shape and v.dtype == vals[a].dtype and _discrete_operand(v))
    b = ("const", draw(st.sampled_from((0.0, 0.5, -1.0))) if not integer else draw(st.sampled_from((0, 3))))
    if other is not None and other != a and draw(st.booleans()):
        b = other
    t = _pick(draw, vals, lambda v: _broadcastable(v.shape, vals[a].shape) and (v.dtype in INTS) == integer)
    at = tuple(np.broadcast_shapes(vals[a].shape, vals[t].shape))
    f = _pick(draw, vals, lambda v: _broadcastable(v.shape, at) and v.dtype == vals[t].dtype)
    shape = tuple(np.broadcast_shapes(at, vals[f].shape))
    v = Value(shape=shape, dtype=vals[t].dtype, bound=max(vals[t].bound, vals[f].bound),
              prec=coarsest(vals[t].prec, vals[f].prec, vals[a].prec))
    return [(("where", kind, a, b, t, f), v)]


def _axes(draw, rank: int) -> tuple[int, ...]:
    return tuple(sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1, max_size=rank))))


def _step_reduce(draw, vals, ctx):
    integer = ctx.integer
    i = _pick(draw, vals, lambda v: (v.dtype in INTS) == integer and v.dtype != "bool")
    if i is None:
        return None
    v = vals[i]
    axes = _axes(draw, len(v.shape))
    kind = draw(st.sampled_from(("sum", "max", "min") if integer else REDUCE))
    if ctx.grad and kind in ("max", "min") and not _discrete_operand(v):
        kind = "sum"  # (its gradient picks the elements equal to the maximum)
    count = math.prod(v.shape[a] for a in axes)
    made = []
    if kind in ("sum", "mean") and count == 0:
        kind = "sum"
    if kind == "sum" and not integer:
        i = _squashed(draw, vals, i, v.bound * max(count, 1), made)
    if kind in ("max", "min") and count == 0:
        return None  # (no identity for jnp.max of nothing)
    keepdims = draw(st.booleans()) or len(axes) == len(v.shape)
    shape = tuple(1 if d in axes else n for d, n in enumerate(v.shape)) if keepdims else \
        tuple(n for d, n in enumerate(v.shape) if d not in axes)
    bound = vals[i].bound * (max(count, 1) if kind == "sum" else 1)
    made.append((("reduce", kind, i, axes, keepdims),
                 Value(shape=shape, dtype=vals[i].dtype, bound=bound,
                       prec=vals[i].prec if kind in ("max", "min") else coarsest(vals[i].prec, vals[i].dtype))))
    return made


def _step_argmax(draw, vals, ctx):
    integer = ctx.integer
    i = _pick(draw, vals, lambda v: v.exact and v.dtype in FLOATS and 0 not in v.shape)
    if i is None:
        return None
    axis = draw(st.integers(0, len(vals[i].shape) - 1))
    shape = tuple(n for d, n in enumerate(vals[i].shape) if d != axis)
    if not shape:
        return None
    return [(("argmax", i, axis), Value(shape=shape, dtype="float32", bound=float(vals[i].shape[axis]), prec=None))]


def _step_scan(draw, vals, ctx):
    integer = ctx.integer
    i = _pick(draw, vals, lambda v: (v.dtype in INTS) == integer and len(v.shape) >= 1)
    if i is None:
        return None
    v = vals[i]
    axis = draw(st.integers(0, len(v.shape) - 1))
    kind = draw(st.sampled_from(("cumsum", "cummax")))
    if ctx.grad and kind == "cummax" and not _discrete_operand(v):
        kind = "cumsum"  # (its gradient picks the running maxima by comparing elements)
    made = []
    if kind == "cumsum" and not integer:
        i = _squashed(draw, vals, i, v.bound * v.shape[axis], made)
    bound = vals[i].bound * (v.shape[axis] if kind == "cumsum" else 1)
    made.append((("scan", kind, i, axis, draw(st.booleans())),
                 Value(shape=v.shape, dtype=v.dtype, bound=bound,
                       prec=vals[i].prec if kind == "cummax" else coarsest(vals[i].prec, v.dtype))))
    return made


def _step_roll(draw, vals, ctx):
    integer = ctx.integer
    i = _pick(draw, vals, lambda v: (v.dtype in INTS) == integer)
    v = vals[i]
    axis = draw(st.integers(0, len(v.shape) - 1))
    return [(("roll", i, draw(st.integers(-5000, 5000)), axis), v)]


def _step_slice(draw, vals, ctx):
    integer = ctx.integer
    i = _pick(draw, vals, lambda v: (v.dtype in INTS) == integer and max(v.shape) > 1)
    if i is None:
        return None
    v = vals[i]
    axis = draw(st.sampled_from([d for d, n in enumerate(v.shape) if n > 1]))
    start = draw(st.integers(0, v.shape[axis] - 1))
    stop = draw(st.integers(start, v.shape[axis]))
    shape = v.shape[:axis] + (stop - start,) + v.shape[axis + 1:]
    return [(("slice", i, axis, start, stop), dataclasses.replace(v, shape=shape))]


def _step_pad(draw, vals, ctx):
    integer = ctx.integer
    i = _pick(draw, vals, lambda v: (v.dtype in INTS) == integer)
    v = vals[i]
    axis = draw(st.integers(0, len(v.shape) - 1))
    lo, hi = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    shape = v.shape[:axis] + (v.shape[axis] + lo + hi,) + v.shape[axis + 1:]
    if math.prod(shape) > MAX_ELEMS:
        return None
    fill = draw(st.sampled_from((0, 1))) if integer else draw(st.sampled_from((0.0, -1.5)))
    return [(("pad", i, axis, lo, hi, fill), dataclasses.replace(v, shape=shape))]


def _step_concat(draw, vals, ctx):
    integer = ctx.integer
    i = _pick(draw, vals, lambda v: (v.dtype in INTS) == integer)
    v = vals[i]
    axis = draw(st.integers(0, len(v.shape) - 1))
    j = _pick(draw, vals, lambda w: w.dtype == v.dtype and len(w.shape) == len(v.shape) and all(
        a == b for d, (a, b) in enumerate(zip(w.shape, v.shape)) if d != axis))
    shape = v.shape[:axis] + (v.shape[axis] + vals[j].shape[axis],) + v.shape[axis + 1:]
    if math.prod(shape) > MAX_ELEMS:
        return None
    return [(("concat", i, j, axis), Value(shape=shape, dtype=v.dtype, bound=max(v.bound, vals[j].bound),
                                           prec=coarsest(v.prec, vals[j].prec)))]


def _step_transpose(draw, vals, ctx):
    integer = ctx.integer
    i = _pick(draw, vals, lambda v: (v.dtype in INTS) == integer and len(v.shape) >= 2)
    if i is None:
        return None
    v = vals[i]
    perm = tuple(draw(st.permutations(range(len(v.shape)))))
    return [(("transpose", i, perm), dataclasses.replace(v, shape=tuple(v.shape[p] for p in perm)))]


def _step_reshape(draw, vals, ctx):
    integer = ctx.integer
    i = _pick(draw, vals, lambda v: (v.dtype in INTS) == integer)
    v = vals[i]
    shape = list(v.shape)
    if len(shape) >= 2 and (len(shape) == 4 or draw(st.booleans())):
        d = draw(st.integers(0, len(shape) - 2))  # merge two neighbours
        shape[d:d + 2] = [shape[d] * shape[d + 1]]
    else:
        d = draw(st.integers(0, len(shape) - 1))  # split one by a factor of it
        factors = [f for f in (2, 3, 4, 8, 16, 17, 32) if shape[d] % f == 0 and shape[d] > f]
        if not factors:
            return None
        f = draw(st.sampled_from(factors))
        shape[d:d + 1] = [shape[d] // f, f]
    return [(("reshape", i, tuple(shape)), dataclasses.replace(v, shape=tuple(shape)))]


def _step_convert(draw, vals, ctx):
    integer = ctx.integer
    i = _pick(draw, vals, _float)
    if i is None:
        return None
    to = draw(st.sampled_from(FLOATS))
    return [(("convert", i, to), dataclasses.replace(vals[i], dtype=to))]  # (rounding is the same everywhere)


def _step_mask(draw, vals, ctx):
    integer = ctx.integer
    i = _pick(draw, vals, lambda v: (v.dtype in INTS) == integer and len(v.shape) >= 2)
    if i is None:
        return None
    v = vals[i]
    a, b = draw(st.permutations(range(len(v.shape))))[:2]
    fill = 0 if integer else draw(st.sampled_from((0.0, -1e4)))
    return [(("mask", i, a, b, fill), dataclasses.replace(v, bound=max(v.bound, abs(fill))))]


def _step_softmax(draw, vals, ctx):
    integer = ctx.integer
    i = _pick(draw, vals, lambda v: _float(v) and 0 not in v.shape)
    if i is None:
        return None
    v = vals[i]
    axis = draw(st.integers(0, len(v.shape) - 1))
    return [(("softmax", i, axis), Value(shape=v.shape, dtype=v.dtype, bound=1.0, prec=coarsest(v.prec, v.dtype)))]


# --------------------------------------------------------------------------------------------------
# Inputs and the comparison
# --------------------------------------------------------------------------------------------------

def argument_specs(program: FuzzProgram) -> list:
    """ShapeDtypeStructs of the function's arguments (with the cotangents for a gradient)."""
    specs = [jax.ShapeDtypeStruct(program.shape, _DT[d]) for d in program.inputs]
    if program.grad:
        outs = jax.eval_shape(program.forward, *specs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        specs.append(tuple(jax.ShapeDtypeStruct(o.shape, jnp.float32) for o in outs))
    return specs


def fuzz_inputs(program: FuzzProgram, seed: int) -> list:
    """Fresh arguments: standard normal floats (NaN and Inf at about one element in 500 where the
    program asks), integers in [-1000, 1000) (uint32: [0, 2000)), standard normal cotangents."""
    rng = np.random.default_rng(seed)

    def draw(spec):
        dt = np.dtype(spec.dtype)
        if jnp.issubdtype(dt, jnp.integer):
            lo = 0 if jnp.issubdtype(dt, jnp.unsignedinteger) else -1000
            return jnp.asarray(rng.integers(lo, lo + 2000, size=spec.shape), dtype=spec.dtype)
        a = rng.standard_normal(spec.shape).astype(np.float32)
        if program.nan_inf and a.size:
            hit = rng.random(a.shape) < 1 / 500
            a[hit] = rng.choice([np.nan, np.inf, -np.inf], size=int(hit.sum()))
        return jnp.asarray(a, dtype=spec.dtype)

    specs = argument_specs(program)
    args = [draw(s) for s in specs[:len(program.inputs)]]
    if program.grad:
        args.append(tuple(draw(s) for s in specs[-1]))
    return args


# Relative to an output's largest element, by the coarsest rounding its program computes with: four
# units in the last place (our kernels compute half-precision values in float and round them where
# stored, XLA after each native bfloat16/float16 op: they differ by a few units there).
CANCELLED_SCALE = 1.0  # an all-zero reference's scale: the inputs' and cotangents' (standard normal)
# A reference no larger than this everywhere is a cancellation too, left over by float64's own rounding:
# 2.2e-16 of terms that a mean over 32512 elements made 3e-5 leave 3.4e-21 (the GPU fuzzer, a softmax
# gradient whose output is constant: 2^-24 ours, where each bfloat16 term is rounded once, 0 jax.jit's).
CANCELLED_BELOW = 1e-12
RTOL = {None: 1e-5, "float32": 1e-4, "float16": 4 * 2 ** -11, "bfloat16": 4 * 2 ** -8}


def check_against_jit(got, want, ref, lossy: str | None = "float32") -> list[str]:
    """Mismatches of `got` (ours) against `want` (jax.jit), each output judged against `ref` (float64
    reference): NaN and Inf where jax.jit has them; integers equal; floats within a tolerance of the
    reference: RTOL[lossy] (the program's coarsest rounding, FuzzProgram.lossy) of the output's
    largest finite reference element, widened by twice jax.jit's own distance from it. An output
    whose reference is zero everywhere is a cancellation of terms the size of the inputs and
    cotangents (standard normal), and so is one under CANCELLED_BELOW everywhere (float64's residue):
    its scale is 1, what their rounding leaves (a bfloat16 softmax
    over one element: gradient s * (g - g * s), exactly 0, 0.006 in a kernel that rounded one g and
    not the other). Returns a line per failing output."""
    failures = []
    for k, (g, w, r) in enumerate(zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                                      jax.tree_util.tree_leaves(ref), strict=True)):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape or g.dtype != w.dtype:
            failures.append(f"output {k}: {g.shape} {g.dtype} against jax.jit's {w.shape} {w.dtype}")
            continue
        if not jnp.issubdtype(g.dtype, jnp.floating):
            bad = int(np.sum(g != w))
            if bad:
                failures.append(f"output {k}: {bad} of {g.size} integers differ from jax.jit's")
            continue
        g64, w64, r64 = (np.asarray(x, dtype=np.float64) for x in (g, w, r))
        with np.errstate(invalid="ignore"):
            failures += _float_failures(k, g64, w64, r64, coarsest(lossy, g.dtype.name), g.size)
    return failures


def _float_failures(k: int, g64, w64, r64, lossy: str | None, size: int) -> list[str]:
    """check_against_jit's floating comparison of output `k` (all three as float64)."""
    failures = []
    for name, test in (("NaN", np.isnan), ("+Inf", np.isposinf), ("-Inf", np.isneginf)):
        bad = int(np.sum(test(g64) != test(w64)))
        if bad:
            failures.append(f"output {k}: {name} at {bad} positions where jax.jit differs")
    finite = np.isfinite(g64) & np.isfinite(w64) & np.isfinite(r64)
    if not finite.any():
        return failures
    scale = np.max(np.abs(r64[finite]))
    scale = scale if scale > CANCELLED_BELOW else CANCELLED_SCALE
    tol = RTOL[lossy] * max(scale, 1e-6) + 2 * np.abs(w64 - r64)
    err = np.abs(g64 - r64)
    bad = finite & (err > tol)
    if bad.any():
        worst = np.argmax(np.where(bad, err - tol, -np.inf))
        failures.append(f"output {k}: {int(bad.sum())} of {size} elements off (worst {g64.flat[worst]!r} "
                        f"against jax.jit {w64.flat[worst]!r}, reference {r64.flat[worst]!r}, scale {scale:.3g})")
    return failures


def reference(program: FuzzProgram, args) -> list:
    """The program's function on the CPU in float64 (see float64_reference)."""
    return float64_reference(program.function(), args)


def float64_reference(fn, args) -> list:
    """`fn` on the CPU in float64: floating inputs widened, its own conversions still round."""
    enable_x64 = jax.enable_x64 if hasattr(jax, "enable_x64") else __import__("jax.experimental", fromlist=["x"]).enable_x64
    cpu = jax.devices("cpu")[0]
    with enable_x64(True):
        wide = jax.tree_util.tree_map(
            lambda a: jax.device_put(np.asarray(a, dtype=np.float64) if _is_float(a.dtype) else np.asarray(a), cpu), args)
        return jax.jit(fn)(*wide)
