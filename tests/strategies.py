"""Hypothesis strategies: random memory-bound functions ("region graphs") and their inputs.

`region_graphs()` draws an example `(fn, specs, seed)`:

* `fn` is a `RegionGraph`: a plain JAX function of `len(specs)` positional arrays, built from a small
  program over an input `x[N, C]` (float32, bfloat16 or float16), optional column params `[C]`, row params
  `[N]`, a second `[N, C]` input and int32 `labels[N]`. Its ops are what memory-bound model code is made
  of: elementwise ops (mostly computed in float32 after an upcast, like real code, sometimes in the input's
  half type), scalar / row / column broadcasts, selects on comparisons, row reductions (sum, max, min,
  mean, variance-style normalisation, softmax), iota one-hot patterns, argmax over the last axis, the
  row max with its index in one variadic `lax.reduce`, column sums and scalar means as outputs, and
  several outputs at once.
* `specs` is the list of `jax.ShapeDtypeStruct`s of its arguments, `seed` an int for `random_inputs`.

The program is plain data (`fn.program`), so hypothesis prints a failing example readably, and shrinks it.
Every value's magnitude is tracked while drawing: ops that could overflow get their operand squashed first
(`v / (1 + |v|)`), `exp` only ever sees a bounded value, and comparisons only read input values (never a
computed one), so a GPU kernel that rounds differently than XLA moves outputs a little, never flips a
branch. `fn.lossy_dtype` is the lowest precision a *computed* value was rounded to (None if everything
after the inputs stays in float32): tests loosen their tolerance to it. `fn.out_err[i]` bounds how far
output i may move (absolutely) when those roundings happen differently or not at all (XLA on GPUs skips
f32 -> bf16 -> f32 round trips: excess precision); it is 0 for graphs without half-precision math. `fn.abs_variant()` is the same
graph with sums over absolute values: the error scale of outputs that are (or come from) sums.

`exclude` drops features by name (see `FEATURES`); tests use it to keep a known, separately tested
package bug out of the general property tests.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from jaxstitch.bench.workloads import top1_pair

SIZES = (1, 3, 7, 17, 33, 100, 128, 257, 1000, 1024, 4096)
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
MAX_MAG = 1e4          # squash an operand before an op whose result could exceed this
EXP_ARG_BOUND = 4.0    # exp is only applied to values with |v| <= this

# Feature names accepted by `exclude`.
FEATURES = frozenset({
    "fill",         # jnp.where(..., v, 0.0) / jnp.full_like: a broadcast of a literal constant
    "half_math",    # arithmetic directly in bfloat16/float16
    "onehot", "argmax", "topval", "colsum", "scalar_out", "rowred", "norm", "softmax", "where", "outer",
    "row_params", "col_params", "bcast", "unit_sum",
    "single_element",  # N == C == 1
    "single_row",      # N == 1
})

_UNARY = ("tanh", "logistic", "exp", "log1p_abs", "sqrt_abs", "rsqrt_1p_abs", "abs", "neg", "erf",
          "pow2", "pow3", "squash", "clamp", "round_bf16", "round_f16", "unit_sum")
_BINARY = ("add", "sub", "mul", "div_1p_abs", "max", "min")
_COMPARE = ("gt", "lt", "ge", "le", "ne")
_ROWRED = ("sum", "max", "min", "mean")
_NP_DTYPE = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16, "int32": jnp.int32}
_PRECISION = {"float32": 0, "float16": 1, "bfloat16": 2}  # higher = coarser
HALF_ULP = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}  # relative, one unit in the last place


def np_dtype(name: str):
    return _NP_DTYPE[name]


def coarser(a, b):
    """The coarser of two float dtype names (None = no rounding)."""
    if a is None:
        return b
    if b is None:
        return a
    return a if _PRECISION[a] >= _PRECISION[b] else b


# --------------------------------------------------------------------------------------------------
# The interpreter: a program is a tuple of instructions over named values
# --------------------------------------------------------------------------------------------------

def _as_full(v, kind):
    """A row value [N] or [N, 1] broadcasts against [N, C] as [N, 1]; others broadcast as they are."""
    if kind == "row" and v.ndim == 1:
        return v[:, None]
    return v


def _unary(name, v):
    f32 = jnp.float32
    if name == "tanh":
        return jnp.tanh(v)
    if name == "logistic":
        return jax.nn.sigmoid(v)
    if name == "exp":
        return jnp.exp(v)
    if name == "log1p_abs":
        return jnp.log1p(jnp.abs(v))
    if name == "sqrt_abs":
        return jnp.sqrt(jnp.abs(v))
    if name == "rsqrt_1p_abs":
        return jax.lax.rsqrt(1 + jnp.abs(v))
    if name == "abs":
        return jnp.abs(v)
    if name == "neg":
        return -v
    if name == "erf":
        return jax.lax.erf(v)
    if name == "pow2":
        return jax.lax.integer_pow(v, 2)
    if name == "pow3":
        return jax.lax.integer_pow(v, 3)
    if name == "squash":
        return v / (1 + jnp.abs(v))
    if name == "clamp":
        return jax.lax.clamp(jnp.asarray(-1.5, v.dtype), v, jnp.asarray(1.5, v.dtype))
    if name == "round_bf16":
        return v.astype(jnp.bfloat16).astype(f32)
    if name == "round_f16":
        return v.astype(jnp.float16).astype(f32)
    if name == "unit_sum":  # a reduction over an added size-1 axis: moves nothing (vjp code has these)
        return jnp.sum(v[None], axis=0)
    if name == "to_f32":
        return v.astype(f32)
    if name in ("to_bf16", "to_f16"):
        return v.astype(jnp.bfloat16 if name == "to_bf16" else jnp.float16)
    raise ValueError(name)


def _binary(name, a, b):
    if name == "add":
        return a + b
    if name == "sub":
        return a - b
    if name == "mul":
        return a * b
    if name == "div_1p_abs":
        return a / (1 + jnp.abs(b))
    if name == "max":
        return jnp.maximum(a, b)
    if name == "min":
        return jnp.minimum(a, b)
    raise ValueError(name)


def _compare(name, a, b):
    return {"gt": a > b, "lt": a < b, "ge": a >= b, "le": a <= b, "ne": a != b}[name]


class RegionGraph:
    """A random memory-bound function. `inputs` = ((name, kind, dtype), ...) in argument order;
    `program` = ((dst, op, *operands), ...); `outputs` = ((op, *operands), ...)."""

    def __init__(self, n, c, inputs, program, outputs, kinds, lossy_dtype, abs_sums=False, out_err=None):
        self.abs_sums = abs_sums
        self.out_err = tuple(out_err) if out_err is not None else (0.0,) * len(outputs)
        self.n, self.c = n, c
        self.inputs, self.program, self.outputs = tuple(inputs), tuple(program), tuple(outputs)
        self.kinds = dict(kinds)  # value name -> "full" / "row" / "col"
        self.lossy_dtype = lossy_dtype
        self.__name__ = "region_graph"
        self.__qualname__ = "region_graph"

    def abs_variant(self) -> "RegionGraph":
        """The same graph with every sum (row sums, means, column sums) taken over absolute values.

        Its outputs are the natural error scale of the original's: a sum that cancels to ~0 is still
        only as accurate as the sum of its terms' magnitudes. Tests compare against
        max(|reference|, |abs_variant|)."""
        return RegionGraph(self.n, self.c, self.inputs, self.program, self.outputs, self.kinds,
                           self.lossy_dtype, abs_sums=True, out_err=self.out_err)

    def __repr__(self):
        lines = [f"RegionGraph(N={self.n}, C={self.c}, lossy={self.lossy_dtype}, "
                 f"out_err={tuple(float(f'{e:.3g}') for e in self.out_err)})"]
        lines += [f"  in  {name}: {kind} {dt}" for name, kind, dt in self.inputs]
        lines += [f"  {ins[0]} = {ins[1]}{ins[2:]}" for ins in self.program]
        lines += [f"  out {o}" for o in self.outputs]
        return "\n".join(lines)

    def _get(self, env, ref):
        """An operand: a value name, or ('const', float)."""
        if isinstance(ref, tuple) and ref[0] == "const":
            return ref[1]
        return _as_full(env[ref], self.kinds[ref])

    def __call__(self, *args):
        env = {}
        for (name, _, _), a in zip(self.inputs, args):
            env[name] = a
        for ins in self.program:
            dst, op, *rest = ins
            env[dst] = self._eval(env, op, rest)
        outs = tuple(self._out(env, o) for o in self.outputs)
        return outs if len(outs) > 1 else outs[0]

    def _eval(self, env, op, rest):
        c = self.c
        if op == "unary":
            name, src = rest
            return _unary(name, env[src])
        if op == "binary":
            name, a, b = rest
            if self.kinds[a] == "row" and (isinstance(b, tuple) or self.kinds[b] == "row"):
                # row op row (or a constant) stays a row value of a's own shape
                bb = b[1] if isinstance(b, tuple) else env[b].reshape(env[a].shape)
                return _binary(name, env[a], bb)
            return _binary(name, self._get(env, a), self._get(env, b))
        if op == "where":
            cmp, p, q, a, b, fill = rest
            pred = _compare(cmp, self._get(env, p), self._get(env, q))
            if fill:
                return jnp.where(pred, self._get(env, a), 0.0)
            return jnp.where(pred, self._get(env, a), self._get(env, b))
        if op == "full_like":
            (src,) = rest
            return env[src] * jnp.full_like(env[src], 0.5)
        if op == "rowred":
            name, src, keepdims = rest
            v = env[src].astype(jnp.float32)
            if self.abs_sums and name in ("sum", "mean"):
                v = jnp.abs(v)
            if name == "sum":
                return jnp.sum(v, axis=-1, keepdims=keepdims)
            if name == "max":
                return jnp.max(v, axis=-1, keepdims=keepdims)
            if name == "min":
                return jnp.min(v, axis=-1, keepdims=keepdims)
            return jnp.mean(v, axis=-1, keepdims=keepdims)
        if op == "norm":  # layer-norm statistics: mean / variance over the row, then normalise
            (src,) = rest
            v = env[src].astype(jnp.float32)
            m = jnp.mean(v, axis=-1, keepdims=True)
            d = v - m
            var = jnp.mean(d * d, axis=-1, keepdims=True)
            return d * jax.lax.rsqrt(var + 1e-5)
        if op == "softmax":
            (src,) = rest
            v = env[src].astype(jnp.float32)
            e = jnp.exp(v - jnp.max(v, axis=-1, keepdims=True))
            return e / jnp.sum(e, axis=-1, keepdims=True)
        if op == "onehot":
            (src,) = rest
            return jax.nn.one_hot(env[src], c, dtype=jnp.float32)
        raise ValueError(op)

    def _out(self, env, o):
        op, src, *rest = o
        v = env[src]
        if op == "full":
            return v.astype(np_dtype(rest[0]))
        if op == "row":
            return v
        if op == "colsum":
            v = v.astype(jnp.float32)
            return jnp.sum(jnp.abs(v) if self.abs_sums else v, axis=0)
        if op == "argmax":
            return jnp.argmax(v, axis=-1)
        if op in ("topval", "topidx"):  # the row's max and its (first) index in one variadic reduce
            idx = jax.lax.broadcasted_iota(jnp.int32, v.shape, v.ndim - 1)
            top, at = jax.lax.reduce((v, idx), (jnp.array(-jnp.inf, v.dtype), jnp.int32(0)), top1_pair,
                                     (v.ndim - 1,))
            return top if op == "topval" else at
        if op == "mean":
            v = v.astype(jnp.float32)
            return jnp.mean(jnp.abs(v) if self.abs_sums else v)
        if op == "bcast":  # a row or column value broadcast to the full [N, C] as an output
            return jnp.broadcast_to(_as_full(v, self.kinds[src]), (self.n, self.c))
        raise ValueError(op)


# --------------------------------------------------------------------------------------------------
# Drawing
# --------------------------------------------------------------------------------------------------

# Rough jaxpr equation counts, to keep graphs within a budget.
_COST = {"unary": 1, "binary": 2, "where": 3, "full_like": 3, "rowred": 2, "norm": 12, "softmax": 9,
         "onehot": 4}
_UNARY_COST = {"log1p_abs": 2, "sqrt_abs": 2, "rsqrt_1p_abs": 3, "squash": 3, "round_bf16": 2,
               "round_f16": 2, "clamp": 1}


class _Builder:
    def __init__(self, draw, n, c, exclude):
        self.draw, self.n, self.c, self.exclude = draw, n, c, exclude
        self.vals = {}        # name -> dict(kind, dtype, mag, exact)
        self.program = []
        self.cost = 0
        self.lossy = None
        self.counter = 0

    def new(self, kind, dtype, mag, exact=False, err=0.0):
        """`err`: an absolute bound on how far the value may move when half-precision roundings happen
        differently (XLA on GPUs may skip an f32->bf16->f32 round trip: excess precision)."""
        name = f"v{self.counter}"
        self.counter += 1
        self.vals[name] = dict(kind=kind, dtype=dtype, mag=float(mag), exact=exact, err=float(err))
        return name

    def err(self, ref):
        return 0.0 if isinstance(ref, tuple) else self.vals[ref]["err"]

    def emit(self, dst, op, *rest, cost=None):
        self.program.append((dst, op) + tuple(rest))
        self.cost += _COST[op] if cost is None else cost
        meta = self.vals[dst]
        if meta["dtype"] != "float32" and not meta["exact"]:
            self.lossy = coarser(self.lossy, meta["dtype"])
            meta["err"] += meta["mag"] * HALF_ULP[meta["dtype"]]
        return dst

    def pick(self, kinds=("full", "row", "col"), prefer_recent=True, draw=True):
        names = [k for k, m in self.vals.items() if m["kind"] in kinds and m["dtype"] != "int32"]
        if not names or not draw:
            return names[-1] if names else None
        if prefer_recent and len(names) > 1 and self.draw(st.booleans()):
            return names[-1]
        return self.draw(st.sampled_from(names))

    def unary(self, name, src):
        m = self.vals[src]
        mag = m["mag"]
        if name == "exp" and mag > EXP_ARG_BOUND:
            src = self.unary("tanh", src)
            m, mag = self.vals[src], 1.0
        if name in ("pow2", "pow3") and mag ** int(name[-1]) > MAX_MAG:
            src = self.unary("squash", src)
            m, mag = self.vals[src], 1.0
        new_mag = {"tanh": 1, "logistic": 1, "exp": math.exp(min(mag, EXP_ARG_BOUND)), "log1p_abs": math.log1p(mag),
                   "sqrt_abs": math.sqrt(mag), "rsqrt_1p_abs": 1, "abs": mag, "neg": mag, "erf": 1,
                   "pow2": mag ** 2, "pow3": mag ** 3, "squash": 1, "clamp": min(mag, 1.5),
                   "round_bf16": mag, "round_f16": mag, "unit_sum": mag, "to_f32": mag, "to_bf16": mag,
                   "to_f16": mag}[name]
        dtype = m["dtype"]
        if name == "to_f32":
            dtype = "float32"
        elif name in ("to_bf16", "to_f16"):
            dtype = "bfloat16" if name == "to_bf16" else "float16"
        if name in ("round_bf16", "round_f16"):
            if dtype != "float32":
                name = "to_f32"
            else:
                self.lossy = coarser(self.lossy, "bfloat16" if name == "round_bf16" else "float16")
        e = m["err"]
        new_err = {"exp": new_mag * e, "sqrt_abs": math.sqrt(e), "rsqrt_1p_abs": 0.5 * e,
                   "pow2": 2 * mag * e + e * e, "pow3": 3 * (mag + e) ** 2 * e, "erf": 1.13 * e,
                   "logistic": 0.25 * e}.get(name, e)
        if name in ("round_bf16", "round_f16"):
            new_err += mag * HALF_ULP["bfloat16" if name == "round_bf16" else "float16"]
        dst = self.new(m["kind"], dtype, new_mag, err=new_err)
        return self.emit(dst, "unary", name, src, cost=_UNARY_COST.get(name, 1))

    def squash_if(self, name, limit=MAX_MAG):
        if self.vals[name]["mag"] > limit:
            return self.unary("squash", name)
        return name

    def _binary_mag(self, name, a, b):
        ma = self.vals[a]["mag"]
        mb = abs(b[1]) if isinstance(b, tuple) else self.vals[b]["mag"]
        return {"add": ma + mb, "sub": ma + mb, "mul": ma * mb, "div_1p_abs": ma, "max": max(ma, mb),
                "min": max(ma, mb)}[name]

    def binary(self, name, a, b):
        """b: a value name or ('const', x)."""
        if name == "mul":
            mb = b[1] if isinstance(b, tuple) else self.vals[b]["mag"]
            if self.vals[a]["mag"] * abs(mb) > MAX_MAG:
                a = self.squash_if(a, 1.0)
                if not isinstance(b, tuple):
                    b = self.squash_if(b, 1.0)
        mag = self._binary_mag(name, a, b)
        if mag > MAX_MAG:  # keep every value far from float16's range
            a = self.squash_if(a, 1.0)
            if not isinstance(b, tuple):
                b = self.squash_if(b, 1.0)
            mag = self._binary_mag(name, a, b)
        ka = self.vals[a]["kind"]
        kb = "scalar" if isinstance(b, tuple) else self.vals[b]["kind"]
        kind = ka if kb in ("scalar", ka) else ("full" if "full" in (ka, kb) or {ka, kb} == {"row", "col"}
                                               else ka)
        if kb == "scalar":
            dtype = self.vals[a]["dtype"]
        else:
            da, db = self.vals[a]["dtype"], self.vals[b]["dtype"]
            dtype = da if da == db else "float32"  # bf16 with f16 also promotes to f32 in jnp
        ea, eb = self.err(a), self.err(b)
        ma = self.vals[a]["mag"]
        mb = abs(b[1]) if isinstance(b, tuple) else self.vals[b]["mag"]
        err = {"add": ea + eb, "sub": ea + eb, "mul": ma * eb + mb * ea + ea * eb,
               "div_1p_abs": ea + ma * eb, "max": max(ea, eb), "min": max(ea, eb)}[name]
        db = None if isinstance(b, tuple) else self.vals[b]["dtype"]
        if name == "div_1p_abs" and db in HALF_ULP:
            # 1 + |b| is computed in b's half type: a rounding XLA may do and a kernel may skip.
            err += ma * HALF_ULP[db]
            self.lossy = coarser(self.lossy, db)
        dst = self.new(kind, dtype, mag, err=err)
        return self.emit(dst, "binary", name, a, b)


def _const(draw):
    return ("const", draw(st.sampled_from([0.5, -1.25, 2.0, 3.0, 1e-3])))


def count_ops(fn, specs) -> int:
    """Primitive applications in `fn`'s jaxpr, with the bodies of nested jit calls counted inline."""
    def count(jaxpr):
        k = 0
        for e in jaxpr.eqns:
            inner = e.params.get("jaxpr") or e.params.get("call_jaxpr")
            if inner is not None:
                k += count(getattr(inner, "jaxpr", inner))
            else:
                k += 1
        return k
    return count(jax.make_jaxpr(fn)(*specs).jaxpr)


MIN_OPS, MAX_OPS = 3, 25


def region_graphs(max_elems: int = 1 << 18, exclude=()):
    """Examples `(fn, specs, seed)` with MIN_OPS..MAX_OPS primitives; see the module docstring."""
    return _region_graphs(max_elems, tuple(exclude)).filter(
        lambda ex: MIN_OPS <= count_ops(ex[0], ex[1]) <= MAX_OPS)


@st.composite
def _region_graphs(draw, max_elems, exclude, max_cost: int = 16):
    exclude = frozenset(exclude)
    unknown = exclude - FEATURES
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)}")
    n = draw(st.sampled_from([s for s in SIZES if not (s == 1 and "single_row" in exclude)]))
    c = draw(st.sampled_from([s for s in SIZES if n * s <= max_elems
                              and not (n * s == 1 and "single_element" in exclude)]))
    xd = draw(st.sampled_from(FLOAT_DTYPES))
    b = _Builder(draw, n, c, exclude)
    inputs = []

    def add_input(kind, dtype):
        name = b.new(kind, dtype, 5.0 if dtype != "int32" else 0, exact=True)
        shape = {"full": (n, c), "row": (n,), "col": (c,)}[kind]
        inputs.append((name, kind, dtype, shape))
        return name

    x = add_input("full", xd)
    x2 = add_input("full", xd) if draw(st.booleans()) else None
    cols = [] if "col_params" in exclude else [
        add_input("col", draw(st.sampled_from((xd, "float32")))) for _ in range(draw(st.integers(0, 2)))]
    rows = [] if "row_params" in exclude else [
        add_input("row", "float32") for _ in range(draw(st.integers(0, 1)))]
    labels = None
    if "onehot" not in exclude and draw(st.integers(0, 3)) == 0:
        labels = b.new("row", "int32", 0, exact=True)
        inputs.append((labels, "row", "int32", (n,)))
    half_math = "half_math" not in exclude and xd != "float32" and draw(st.booleans())

    # The working value: x upcast like real code, or x itself for some half-precision math first.
    if half_math:
        cur = x
    else:
        cur = b.unary("to_f32", x) if xd != "float32" else x
    computed = [cur]
    budget = draw(st.integers(2, max_cost))
    steps = ["unary", "binary", "binary_param"]
    steps += [s for s in ("where", "rowred", "norm", "softmax", "outer", "fill") if s not in exclude]
    if labels is not None:
        steps.append("onehot")
    while b.cost < budget:
        usable = [s_ for s_ in steps if not (
            (s_ == "binary_param" and not (cols + rows))
            or (s_ == "outer" and (b.pick(("row",), prefer_recent=False, draw=False) is None
                                   or b.pick(("col",), prefer_recent=False, draw=False) is None)))]
        step = draw(st.sampled_from(usable))
        room = budget - b.cost
        if step in ("norm", "softmax") and room < _COST[step]:
            step = "unary"
        src = b.pick(("full",)) if draw(st.booleans()) else cur
        if step in ("rowred", "norm", "softmax") and b.vals[src]["kind"] != "full":
            src = b.pick(("full",))
        if step == "unary":
            names = [u for u in _UNARY if u not in exclude and not (
                u.startswith("round_") and b.vals[src]["dtype"] != "float32" and u != "round_bf16")]
            cur = b.unary(draw(st.sampled_from(names)), src)
        elif step == "binary":
            other = b.pick(("full", "row", "col")) if draw(st.integers(0, 3)) else _const(draw)
            cur = b.binary(draw(st.sampled_from(_BINARY)), src, other)  # half with f32 promotes to f32
        elif step == "binary_param":
            params = cols + rows
            if not params:
                continue
            p = draw(st.sampled_from(params))
            if b.vals[src]["dtype"] != "float32" and b.vals[p]["dtype"] == "float32":
                src = b.unary("to_f32", src)
            cur = b.binary(draw(st.sampled_from(("add", "mul", "sub", "div_1p_abs"))), src, p)
        elif step == "where":
            pred_lhs = draw(st.sampled_from([x] + ([x2] if x2 else [])))
            rhs_options = [("const", 0.0)] + cols + [r for r in rows] + ([x2] if x2 and pred_lhs != x2 else [])
            rhs = draw(st.sampled_from(rhs_options))
            other = b.pick(("full", "row", "col"))
            fill = "fill" not in exclude and draw(st.integers(0, 3)) == 0
            ma = max(b.vals[src]["mag"], b.vals[other]["mag"])
            da, db = b.vals[src]["dtype"], b.vals[other]["dtype"]
            dtype = da if (fill or da == db) else "float32"
            dst = b.new("full", dtype, ma, err=max(b.err(src), b.err(other)))
            cur = b.emit(dst, "where", draw(st.sampled_from(_COMPARE)), pred_lhs, rhs, src, other, fill)
        elif step == "fill":
            dst = b.new(b.vals[src]["kind"], b.vals[src]["dtype"], b.vals[src]["mag"] * 0.5,
                        err=0.5 * b.err(src))
            cur = b.emit(dst, "full_like", src)
        elif step == "rowred":
            kind = draw(st.sampled_from(_ROWRED))
            mag = b.vals[src]["mag"] * (c if kind == "sum" else 1)
            err = b.err(src) * (c if kind == "sum" else 1)
            row = b.emit(b.new("row", "float32", mag, err=err), "rowred", kind, src, draw(st.booleans()))
            if draw(st.booleans()):  # broadcast it back (mean-subtraction / scaling style)
                row = b.squash_if(row)
                full = src if b.vals[src]["dtype"] == "float32" else b.unary("to_f32", src)
                cur = b.binary(draw(st.sampled_from(("sub", "mul", "div_1p_abs", "add"))), full, row)
            else:
                cur = row
        elif step in ("norm", "softmax"):
            mag = math.sqrt(c) + 1 if step == "norm" else 1.0
            e, m = b.err(src), b.vals[src]["mag"]
            # softmax: an input moved by e moves each output by a factor e^(2e); norm: relative error
            # kept, with room for cancellation when the mean dominates
            err = 2 * e * math.exp(2 * e) if step == "softmax" else 4 * mag * e / max(m, 1e-6)
            cur = b.emit(b.new("full", "float32", mag, err=err), step, src)
        elif step == "outer":
            r = b.pick(("row",))
            w = b.pick(("col",))
            if r is None or w is None:
                continue
            if b.vals[r]["dtype"] != b.vals[w]["dtype"]:
                r = b.unary("to_f32", r) if b.vals[r]["dtype"] != "float32" else r
                w = b.unary("to_f32", w) if b.vals[w]["dtype"] != "float32" else w
            cur = b.binary(draw(st.sampled_from(("add", "mul", "sub"))), r, w)
        elif step == "onehot":
            oh = b.emit(b.new("full", "float32", 1.0), "onehot", labels)
            full = src if b.vals[src]["dtype"] == "float32" else b.unary("to_f32", src)
            cur = b.binary("mul", oh, full)
        computed.append(cur)

    # Outputs: the last full value always (in x's dtype or float32), plus up to two more.
    last_full = next((v for v in reversed(computed) if b.vals[v]["kind"] == "full"), None)
    if last_full is None or last_full == x:
        last_full = b.unary("tanh", x if xd == "float32" else b.unary("to_f32", x))
    outputs = [("full", last_full, draw(st.sampled_from((xd, "float32"))))]
    extra = ["full", "row"] + [e for e in ("colsum", "argmax", "topval", "scalar_out", "bcast") if e not in exclude]
    for _ in range(draw(st.integers(0, 2))):
        what = draw(st.sampled_from(extra))
        if what == "full":
            v = b.pick(("full",), prefer_recent=False)
            if v not in (None, x, x2) and all(o[1] != v for o in outputs):
                outputs.append(("full", v, draw(st.sampled_from((xd, "float32")))))
        elif what == "row":
            v = b.pick(("row",), prefer_recent=False)
            if v is not None and b.vals[v]["kind"] == "row" and v not in rows \
                    and all(o[1] != v for o in outputs):
                outputs.append(("row", v))
        elif what == "colsum":
            v = b.pick(("full",), prefer_recent=False)
            outputs.append(("colsum", b.squash_if(v, 100.0)))
        elif what == "argmax":
            outputs.append(("argmax", draw(st.sampled_from([x] + ([x2] if x2 else [])))))
        elif what == "topval":  # of an input: a pick compares only exact values
            outputs.append((draw(st.sampled_from(("topval", "topidx"))), draw(st.sampled_from([x] + ([x2] if x2 else [])))))
        elif what == "bcast":
            v = b.pick(("row", "col"), prefer_recent=False)
            if v is not None:
                outputs.append(("bcast", v))
        elif what == "scalar_out":
            v = b.pick(("row",), prefer_recent=False)
            if v is not None and v not in rows:
                outputs.append(("mean", b.squash_if(v, 100.0)))
    specs = [jax.ShapeDtypeStruct(shape, np_dtype(dt)) for _, _, dt, shape in inputs]

    def make():
        kinds = {k: m["kind"] for k, m in b.vals.items()}
        out_err = tuple({"colsum": n * b.err(o[1]), "argmax": 0.0, "topval": 0.0, "topidx": 0.0}.get(o[0], b.err(o[1]))
                        for o in outputs)
        return RegionGraph(n, c, [(nm, k, dt) for nm, k, dt, _ in inputs], b.program, outputs, kinds,
                           b.lossy, out_err=out_err)

    fn = make()
    if len(outputs) > 1 and count_ops(fn, specs) > MAX_OPS:  # too big: keep only the main output
        del outputs[1:]
        fn = make()
    while count_ops(fn, specs) < MIN_OPS:  # too small: one more op on the first output
        first = outputs[0]
        outputs[0] = (first[0], b.unary("tanh", first[1])) + tuple(first[2:])
        fn = make()
    seed = draw(st.integers(0, 2 ** 31 - 1))
    return fn, specs, seed


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------

def random_inputs(specs, seed):
    """Fresh random arrays for `specs`: standard normal floats with no exact zeros; int32 arrays are
    labels drawn uniformly from [0, C), C being the last axis of the first spec."""
    rng = np.random.default_rng(seed)
    n_classes = specs[0].shape[-1] if specs and specs[0].shape else 1
    out = []
    for s in specs:
        dt = np.dtype(s.dtype)
        if jnp.issubdtype(dt, jnp.integer):
            out.append(jnp.asarray(rng.integers(0, max(1, n_classes), size=s.shape), dtype=s.dtype))
            continue
        a = rng.standard_normal(s.shape).astype(np.float32)
        a = np.array(jnp.asarray(a, dtype=s.dtype).astype(jnp.float32))
        a[a == 0] = 1.0  # no exact zeros, even after rounding to a half type
        out.append(jnp.asarray(a, dtype=s.dtype))
    return out


# --------------------------------------------------------------------------------------------------
# Forcing the planner's hand
# --------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def force_stitching(where=None):
    """Within the block, every region that has a kernel plan is stitched, whatever the cost model says
    (with `where`, those whose region `where(region)` holds).

    Random graphs are mostly small one-pass regions that the cost model (rightly) leaves to XLA; forcing
    them through codegen, the stitcher's rebuild and (on a GPU) our kernels is what tests those parts.
    Patches `plan_region` where the pipeline calls it (its first try) and where the planner's
    candidates come from (`jaxstitch.plan.candidates`), and `pipeline.MIN_RESIDENT_WARPS`."""
    from jaxstitch.driver import pipeline
    from jaxstitch.plan import candidates

    original = getattr(pipeline, "plan_region", None)
    if original is None or getattr(candidates, "plan_region", None) is not original:
        raise AssertionError("the pipeline's or the candidates' plan_region is gone: update tests/strategies.force_stitching")

    def plan_without_cost_veto(*args, **kwargs):
        plan = original(*args, **kwargs)
        if plan.kernel is not None and plan.reason is not None and (where is None or where(plan.region)):
            plan = dataclasses.replace(plan, reason=None, reason_kind=None, reason_op=None)
        return plan

    # (the veto on kernels with too few resident warps, taken after NVRTC, is the cost model's too,
    # as is a shape family's row count below which XLA runs the region)
    from jaxstitch.integration import families
    min_warps, xla_below = pipeline.MIN_RESIDENT_WARPS, families._xla_below
    pipeline.plan_region, pipeline.MIN_RESIDENT_WARPS = plan_without_cost_veto, 0
    candidates.plan_region = plan_without_cost_veto
    families._xla_below = lambda *args: 0
    try:
        yield
    finally:
        pipeline.plan_region, pipeline.MIN_RESIDENT_WARPS = original, min_warps
        candidates.plan_region = original
        families._xla_below = xla_below


def assert_same_as_jax_jit(fun, args):
    """`jaxstitch.jit(fun)` gives jax.jit's results bit for bit (the CPU fallback: the same program)."""
    import jaxstitch

    got, want = jaxstitch.jit(fun)(*args), jax.jit(fun)(*args)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def traced_values(traced, args, bind=None) -> dict:
    """Every value of a traced program (trace.trace) on `args`, by id: each equation bound again,
    with XLA (or `bind(eqn, inputs)`, a stand-in for some of them)."""
    from jaxstitch.core import ir
    from jaxstitch.frontend import trace as trace_mod

    bind = bind or trace_mod.bind_eqn
    env = dict(traced.consts)
    for v, a in zip(traced.graph.inputs, args):
        env[v.id] = a
    for e in traced.eqns:
        ins = [np.asarray(trace_mod.evaluate([], [], [], [a])[0]) if isinstance(a, ir.Const) else env[a.id]
               for a in e.inputs]
        with np.errstate(invalid="ignore"):
            for v, o in zip(e.outputs, bind(e, ins)):
                env[v.id] = np.asarray(o)
    return env
