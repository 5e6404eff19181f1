"""Trace a function to a flat equation list and a frozen `ir.Graph`.

This is the one module that walks jaxprs. It inlines `pjit`/`closed_call`/`custom_jvp_call`/
`custom_vjp_call`/`checkpoint` bodies (jax.nn wraps its functions in them) so regions can span them,
and writes a threefry `random_bits` out as its integer ops (prng.py: dropout's bits), a
scatter-add of one value per row into a fill as a select (row_scatter.py) and other half-precision
scatter-adds into fills as float32 ones (wide_scatter.py); everything else is kept as an opaque
equation that `rebuild` binds again unchanged.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.extend import core as jcore

from ..core import ir
from . import (
    batched_products,
    composed_transposes,
    cse,
    fp_conversions,
    merged_products,
    predicate_products,
    prng,
    row_scatter,
    transposed_products,
    wide_scatter,
)

_INLINED = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
            "custom_vjp_call_jaxpr", "checkpoint", "remat")
_JAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


@dataclasses.dataclass(frozen=True, eq=False)
class Eqn:
    """A flat equation: the primitive and params to bind again, over ir atoms."""

    primitive: Any
    params: dict
    inputs: tuple[ir.Atom, ...]
    outputs: tuple[ir.Value, ...]
    effectful: bool = False
    # a concatenation merged_products.py made for products to read (or, with product_concats, one
    # it found only products read): XLA would copy it in a kernel of its own after writing its
    # operands, so only our kernel writing it pays (plan/cost.py)
    for_products: bool = False
    # where the user's code made it (jax's SourceInfo; `source_line` summarizes it), for reports
    source_info: Any = None


def source_line(eqn: Eqn) -> str:
    """`file:line (function)` of the user's code that made `eqn`, or "" where unknown."""
    if eqn.source_info is None:
        return ""
    from jax.extend import source_info_util

    try:
        return source_info_util.summarize(eqn.source_info)
    except Exception:  # noqa: BLE001 - a report line must never fail
        return ""


@dataclasses.dataclass(frozen=True, eq=False)
class Traced:
    graph: ir.Graph
    eqns: tuple[Eqn, ...]
    consts: dict  # value id -> array captured by the jaxpr
    out_tree: Any
    # Equations written out as other ops, by kind: (name, count) pairs (prng.py's random_bits,
    # row_scatter.py's scatter-adds, wide_scatter.py's "scatter-add in float32"), for the report.
    rewritten: tuple[tuple[str, int], ...] = ()


def _dtype_name(dtype) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:  # extended dtypes (PRNG keys) never join a region
        return str(dtype)


def _dim(d):
    """A dimension as an int, or as it is when symbolic (jax.export; families.py plans at sizes)."""
    return int(d) if isinstance(d, (int, np.integer)) else d


def _hashable_params(params: dict) -> tuple[tuple[str, Any], ...]:
    """The params planning may read, in a hashable canonical form (NumPy scalars as Python ones:
    `jnp.roll` gives its concatenate a NumPy integer `dimension`); jaxprs and callables are dropped."""
    out = []
    for key in sorted(params):
        val = _canonical(params[key])
        if val is not _DROPPED:
            out.append((key, val))
    return tuple(out)


_DROPPED = object()


def _comparable_params(eqn: Eqn) -> tuple | None:
    """All of an equation's params in canonical form (or as themselves where they hash: a
    NamedSharding), or None where one is a jaxpr, a callable or unhashable: equations with such
    params are never taken for equal (cse.py)."""
    out = []
    for key in sorted(eqn.params):
        val = _canonical(eqn.params[key])
        if val is _DROPPED:
            val = eqn.params[key]  # (a sharding, under a mesh: compared as itself, where it hashes)
            try:
                hash(val)
            except TypeError:
                return None
            if callable(val) or isinstance(val, (jcore.Jaxpr, jcore.ClosedJaxpr)):
                return None
        out.append((key, val))
    return tuple(out)


def _canonical(val):
    """`val` as planning reads it: Python scalars, dtype names, tuples of those; _DROPPED otherwise."""
    if isinstance(val, np.generic) and not isinstance(val, np.void):
        val = val.item()
    if isinstance(val, (bool, int, float, str)) or val is None:
        return val
    if isinstance(val, np.dtype) or (isinstance(val, type) and issubclass(val, np.generic)):
        return _dtype_name(val)
    if hasattr(val, "dtype") and hasattr(val, "itemsize") and not hasattr(val, "shape"):
        return _dtype_name(val)
    if isinstance(val, (tuple, list)):
        items = tuple(_canonical(v) for v in val)
        if all(isinstance(v, int) for v in items) or all(isinstance(v, tuple) for v in items):
            return items  # (axes, sizes; tuples of them: pad's padding_config)
    return _DROPPED


def _inner_jaxpr(eqn):
    for name in _JAXPR_PARAMS:
        inner = eqn.params.get(name)
        if inner is None:
            continue
        if isinstance(inner, jcore.ClosedJaxpr):
            return inner.jaxpr, inner.consts
        if isinstance(inner, jcore.Jaxpr):
            return inner, ()
    return None


def _expansion(eqn, fill: ir.Const | None, scatters: bool, wide_scatters: bool):
    """(kind, jaxpr, consts) to write `eqn` out as, else None: a threefry `random_bits` as its
    elementwise ops (prng.py), a scatter-add of one value per row into a fill (`fill`: the scalar its
    first operand broadcasts, else None) as a select (row_scatter.py; unless not `scatters`), another
    half-precision scatter-add into a fill in float32 (wide_scatter.py; unless not `wide_scatters`)."""
    if scatters and row_scatter.expandable(eqn, fill is not None):
        closed = row_scatter.expand(eqn)
        return eqn.primitive.name, closed.jaxpr, closed.consts
    if wide_scatters and wide_scatter.expandable(eqn, fill is not None):
        closed = wide_scatter.expand(eqn, fill.value)
        return WIDENED, closed.jaxpr, closed.consts
    if eqn.primitive.name != "random_bits":
        return None
    key_aval, (shape, width) = eqn.invars[0].aval, (eqn.params["shape"], eqn.params["bit_width"])
    if not prng.expandable(key_aval, width, shape):
        return None
    closed = prng.expand(key_aval, shape)
    return None if closed is None else (eqn.primitive.name, closed.jaxpr, closed.consts)


WIDENED = "scatter-add in float32"  # the report's name for wide_scatter.py's rewrites


class _Flattener:
    def __init__(self, scatters: bool = True, wide_scatters: bool = True):
        self.scatters = scatters  # write scatters into fills out as selects (row_scatter.py)
        self.wide_scatters = wide_scatters  # half-precision ones in float32 (wide_scatter.py)
        self.ids = itertools.count()
        self.eqns: list[Eqn] = []
        self.consts: dict[int, Any] = {}
        self.producer: dict[int, Eqn] = {}  # value id -> the equation that made it
        self.rewritten: dict[str, int] = {}  # kind -> equations written out (_expansion)

    def fill_of(self, a: ir.Atom) -> ir.Const | None:
        """The literal `a` broadcasts, where `a` is a scalar broadcast to an array (a broadcast_in_dim
        of a literal), else None."""
        e = self.producer.get(a.id) if isinstance(a, ir.Value) else None
        if e is not None and e.primitive.name == "broadcast_in_dim" and isinstance(e.inputs[0], ir.Const):
            return e.inputs[0]
        return None

    def new_value(self, aval) -> ir.Value:
        return ir.Value(next(self.ids), tuple(_dim(d) for d in aval.shape), _dtype_name(aval.dtype))

    def atom(self, env, x) -> ir.Atom:
        if isinstance(x, jcore.Literal):
            val = x.val
            # a non-scalar literal, or a float0 one (a symbolic zero tangent), is a captured constant
            if np.ndim(val) != 0 or x.aval.dtype == jax.dtypes.float0:
                v = self.new_value(x.aval)
                self.consts[v.id] = val
                return v
            if hasattr(val, "shape"):
                val = np.asarray(val).item()
            return ir.Const(val, _dtype_name(x.aval.dtype))
        return env[x]

    def run(self, jaxpr, consts, in_atoms) -> list[ir.Atom]:
        env = {}
        for var, c in zip(jaxpr.constvars, consts):
            v = self.new_value(var.aval)
            self.consts[v.id] = c
            env[var] = v
        for var, a in zip(jaxpr.invars, in_atoms):
            env[var] = a
        for eqn in jaxpr.eqns:
            ins = [self.atom(env, x) for x in eqn.invars]
            if eqn.primitive.name in _INLINED:
                inner = _inner_jaxpr(eqn)
            else:
                written = _expansion(eqn, self.fill_of(ins[0]) if ins else None, self.scatters, self.wide_scatters)
                inner = written and written[1:]
                if written:
                    self.rewritten[written[0]] = self.rewritten.get(written[0], 0) + 1
            if inner is not None:
                outs = self.run(inner[0], inner[1], ins)
                for var, o in zip(eqn.outvars, outs):
                    env[var] = o
                continue
            outs = tuple(self.new_value(v.aval) for v in eqn.outvars)
            for var, o in zip(eqn.outvars, outs):
                env[var] = o
            self.eqns.append(Eqn(eqn.primitive, dict(eqn.params), tuple(ins), outs, bool(eqn.effects),
                                 source_info=getattr(eqn, "source_info", None)))
            for o in outs:
                self.producer[o.id] = self.eqns[-1]
        return [self.atom(env, x) for x in jaxpr.outvars]


def trace(fun: Callable, flat_args: Sequence[Any], in_tree, static: dict | None = None,
          scatters: bool = True, wide_scatters: bool = True, merge_products: bool = False,
          batched_folds: int = 0, product_concats: bool = False, excess_precision: bool = True) -> Traced:
    """Trace `fun(*args, **kwargs)` given the dynamic leaves of `(args, kwargs)` (arrays, tracers or
    ShapeDtypeStructs); `static` maps the positions of the other leaves to their Python values.
    `scatters`: write a scatter-add of one value per row into a fill out as a select (row_scatter.py;
    JAXSTITCH_TUNE's scatters=0 keeps it a scatter); `wide_scatters`: a half-precision scatter-add
    into a fill in float32 (wide_scatter.py; wide_scatters=0 keeps XLA's); `merge_products`: matrix
    products sharing an operand, or summed, as one product of concatenations where those are free
    (merged_products.py; JAXSTITCH_TUNE's merge_products=0 turns it off), after transposes of
    products are folded into them (transposed_products.py); `batched_folds`: batched products'
    transposes of the minor axis folded into them (batched_products.py: 1 those that open a value to
    our regions, 2 every one); `product_concats`: every
    concatenation only products read counted as one XLA copies (merged_products.py);
    `excess_precision`: chains of floating conversions collapsed as XLA collapses them
    (fp_conversions.py)."""
    out_tree_box = []
    static = static or {}
    args, kwargs = _with_static_hidden(flat_args, in_tree, static)
    try:
        closed = jax.make_jaxpr(_as_traced(fun, in_tree, static, out_tree_box))(*args, **kwargs)
    except Exception as e:  # the user's function failed: the user's error, raised as it is
        _mark_as_users(e)
        raise
    graph, eqns, consts, rewritten = _flatten(closed, scatters, wide_scatters, merge_products,
                                              batched_folds, product_concats, excess_precision)
    return Traced(graph, eqns, consts, out_tree_box[0], rewritten)


_USERS = "_jaxstitch_users_error"


def _mark_as_users(e: BaseException) -> None:
    try:
        setattr(e, _USERS, True)
    except AttributeError:  # (an exception type without a __dict__ is never taken for ours)
        pass


def users_error(e: BaseException) -> bool:
    """Whether `e` came out of tracing the user's function (not out of jaxstitch's own work)."""
    return bool(getattr(e, _USERS, False))


class _Static:
    """A static leaf, as a pytree node without leaves: `jax.make_jaxpr` then traces the user's own
    argument structure (naming arguments as jax.jit does) with the static leaves baked in."""

    def __init__(self, value):
        self.value = value


jax.tree_util.register_pytree_node(_Static, lambda s: ((), s), lambda s, _: s)  # (compared by identity)


def _with_static_hidden(flat_args: Sequence[Any], in_tree, static: dict):
    """(args, kwargs) of the call, with the dynamic leaves `flat_args` and the static ones hidden."""
    it = iter(flat_args)
    leaves = [_Static(static[i]) if i in static else next(it) for i in range(len(flat_args) + len(static))]
    return jax.tree_util.tree_unflatten(in_tree, leaves)


def _as_traced(fun: Callable, in_tree, static: dict, out_tree_box: list) -> Callable:
    """`fun` over (args, kwargs) from `_with_static_hidden`, named after `fun` so that jax's errors
    name the user's function (its file and line) and arguments (`x`, `args[0]['w']`), as jax.jit's."""
    def traced(*args, **kwargs):
        it = iter(jax.tree_util.tree_leaves((args, kwargs)))
        leaves = [static[i] if i in static else next(it) for i in range(in_tree.num_leaves)]
        args, kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
        out = fun(*args, **kwargs)
        out_tree_box.append(jax.tree_util.tree_structure(out))
        return out

    functools.update_wrapper(traced, fun, updated=())  # (jax reads the signature through __wrapped__)
    inner = fun
    while isinstance(inner, functools.partial):  # (named after the function, as jax.jit names a partial)
        inner = inner.func
    if inner is not fun:
        try:
            traced.__signature__ = inspect.signature(fun)
        except (TypeError, ValueError):
            pass
        traced.__wrapped__ = inner
    return traced


def at_sizes(traced: Traced, size: Callable[[Any], int]) -> Traced:
    """A program traced with symbolic dimensions (jax.export) as one of its sizes: every shape and
    shape param evaluated by `size`, over the same op indices and value ids, so that a region planned
    here is the symbolic program's region op for op (families.py plans at sample sizes). Cheaper
    than tracing the function again at those sizes, and exactly the program that runs: a size read
    as a value stays the op that reads it (`dim_as_value`), not a literal. The equations keep their
    symbolic params: this is planned, never run."""
    values: dict[int, ir.Value] = {}
    sizes: dict = {}

    def dim(d) -> int:
        if isinstance(d, (int, np.integer)):
            return int(d)
        if d not in sizes:
            sizes[d] = size(d)
        return sizes[d]

    def value(v: ir.Value) -> ir.Value:
        if v.id not in values:
            values[v.id] = ir.Value(v.id, tuple(dim(d) for d in v.shape), v.dtype)
        return values[v.id]

    def atom(a: ir.Atom) -> ir.Atom:
        return value(a) if isinstance(a, ir.Value) else a

    def sized(p):
        if type(p) in (tuple, list):
            return type(p)(sized(x) for x in p)
        return dim(p) if jax.export.is_symbolic_dim(p) else p

    ops = tuple(
        ir.Op(op.index, op.prim, tuple(atom(a) for a in op.inputs), tuple(value(v) for v in op.outputs),
              _hashable_params({k: sized(v) for k, v in e.params.items()}) + _extra_params(e))
        for op, e in zip(traced.graph.ops, traced.eqns))
    g = traced.graph
    graph = ir.Graph(tuple(value(v) for v in g.inputs), tuple(atom(a) for a in g.outputs), ops)
    return Traced(graph, traced.eqns, traced.consts, traced.out_tree, traced.rewritten)


def from_closed(closed) -> Traced:
    """A closed jaxpr (a region's, say) as a Traced of positional arguments."""
    graph, eqns, consts, rewritten = _flatten(closed)
    return Traced(graph, eqns, consts, jax.tree_util.tree_structure(list(graph.outputs)), rewritten)


def positional_tree(args: Sequence[Any]):
    """The `in_tree` of a call `fun(*args)` with flat positional arrays (for `trace`)."""
    return jax.tree_util.tree_structure((tuple(args), {}))


def _flatten(closed, scatters: bool = True, wide_scatters: bool = True,
             merge_products: bool = False, batched_folds: int = 0,
             product_concats: bool = False, excess_precision: bool = True) -> tuple[ir.Graph, tuple[Eqn, ...], dict, tuple]:
    """A closed jaxpr as a graph over fresh values, its live equations, its captured constants and
    the equations written out (Traced.rewritten). With `excess_precision` (XLA's default on GPUs),
    chains of floating conversions collapse as XLA collapses them (fp_conversions.py); products with
    a converted predicate are the selects XLA makes of them (predicate_products.py); transposes of
    transposes are composed as XLA composes them (composed_transposes.py)."""
    fl = _Flattener(scatters, wide_scatters)
    inputs = tuple(fl.new_value(v.aval) for v in closed.jaxpr.invars)
    outputs = fl.run(closed.jaxpr, closed.consts, inputs)
    eqns = fl.eqns
    if excess_precision:
        eqns, collapsed = fp_conversions.collapse(eqns)
        if collapsed:
            fl.rewritten[fp_conversions.REPORTED] = collapsed
    eqns, selects = predicate_products.as_selects(eqns, lambda shape, dtype: ir.Value(next(fl.ids), shape, dtype))
    if selects:
        fl.rewritten[predicate_products.REPORTED] = selects
    eqns, outputs, transposes = composed_transposes.compose(eqns, outputs)
    if transposes:
        fl.rewritten[composed_transposes.REPORTED] = transposes
    eqns, outputs, _ = cse.merge_equal(eqns, outputs, _comparable_params)
    if batched_folds:
        eqns, folded = batched_products.fold_batched(
            eqns, outputs, lambda shape, dtype: ir.Value(next(fl.ids), shape, dtype), batched_folds)
        if folded:
            fl.rewritten[batched_products.FOLDED] = folded
    if merge_products:
        eqns, written = _merged(eqns, outputs, fl.ids)
        fl.rewritten.update(written)
    if product_concats:
        eqns, _ = merged_products.mark_product_concatenations(eqns, outputs)
    eqns = _live_eqns(eqns, outputs)
    ops = tuple(
        ir.Op(i, e.primitive.name, e.inputs, e.outputs, _hashable_params(e.params) + _extra_params(e))
        for i, e in enumerate(eqns)
    )
    return ir.Graph(inputs, tuple(outputs), ops), eqns, fl.consts, tuple(sorted(fl.rewritten.items()))


def _merged(eqns: list[Eqn], outputs, ids) -> tuple[list[Eqn], dict[str, int]]:
    """The equations with matrix products merged (merged_products.py), after transposes of products
    are folded into them (transposed_products.py), and how many of each; unchanged where nothing
    merges (XLA folds those transposes itself in a program without merged products)."""
    folded_eqns, folded = transposed_products.fold_transposes(eqns, outputs)
    merged_eqns, merged = merged_products.merge_products(
        folded_eqns, outputs, lambda shape, dtype: ir.Value(next(ids), shape, dtype))
    if not merged:
        return eqns, {}
    written = {merged_products.MERGED: merged}
    if folded:
        written[transposed_products.FOLDED] = folded
    return merged_eqns, written


def _extra_params(eqn: Eqn) -> tuple[tuple[str, Any], ...]:
    """Params `_hashable_params` cannot keep as they are: a scan's sizes, a dot_general's dimension
    numbers (as tuples of ints: plan/scan.py reads them), a variadic reduce's (`_reduce_params`), and
    which concatenations merged_products.py wrote (Eqn.for_products)."""
    if eqn.primitive.name == "scan":
        parts = scan_parts(eqn)
        if parts is None:
            return ()
        return (("length", int(eqn.params["length"])), ("num_consts", parts[0]), ("num_carry", parts[1]),
                ("reverse", bool(eqn.params.get("reverse", False))))
    if eqn.primitive.name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        return (("dimension_numbers", tuple(tuple(tuple(int(d) for d in x) for x in pair)
                                            for pair in ((lc, rc), (lb, rb)))),)
    if eqn.for_products:
        return (("for_products", True),)
    return _reduce_params(eqn)


def _reduce_params(eqn: Eqn) -> tuple[tuple[str, Any], ...]:
    """A variadic `reduce`'s reduced axes (as `axes`, like reduce_sum's) and its combiner: the body
    jaxpr flattened to an `ir.Graph` over scalars, (accumulators..., elements...) -> accumulators...,
    or None when it captures constants (planning then leaves the reduce to XLA)."""
    if eqn.primitive.name != "reduce":
        return ()
    combiner, _, consts, _ = _flatten(eqn.params["jaxpr"])
    return (("axes", tuple(int(d) for d in eqn.params["dimensions"])), ("combiner", None if consts else combiner))


def _live_eqns(eqns: Sequence[Eqn], outputs: Sequence[ir.Atom]) -> tuple[Eqn, ...]:
    """The equations that outputs depend on, and those with effects. Inlined bodies leave dead code
    (a vjp computes tangents nobody reads, e.g. reduce_max's argmax mask), which XLA would remove but
    which would otherwise cost a stitched kernel a reduction."""
    return ir.live(eqns, outputs, keep=lambda e: e.effectful)


def aval_of(v: ir.Value):
    return jax.ShapeDtypeStruct(v.shape, np.dtype(v.dtype) if v.dtype != "bfloat16" else jax.numpy.bfloat16)


def bind_eqn(eqn: Eqn, args: Sequence[Any]) -> list:
    out = eqn.primitive.bind(*args, **eqn.params)
    return list(out) if eqn.primitive.multiple_results else [out]


def const_array(c: ir.Const):
    """A scalar literal operand as the array to bind a primitive with."""
    return np.array(c.value, dtype=jax.numpy.dtype(c.dtype))


def evaluate(eqns: Sequence[Eqn], in_values: Sequence[ir.Value], args, out_atoms, consts=None):
    """Evaluate equations over ir atoms by binding each primitive again (a tiny jaxpr interpreter)."""
    env = dict(consts or {})
    for v, a in zip(in_values, args):
        env[v.id] = a

    def read(a):
        return const_array(a) if isinstance(a, ir.Const) else env[a.id]

    for eqn in eqns:
        outs = bind_eqn(eqn, [read(a) for a in eqn.inputs])
        for v, o in zip(eqn.outputs, outs):
            env[v.id] = o
    return [read(a) for a in out_atoms]


def region_jaxpr(eqns: Sequence[Eqn], in_values: Sequence[ir.Value], out_values: Sequence[ir.Value], consts):
    """A ClosedJaxpr computing a region's outputs from its inputs (the XLA fallback and for transforms)."""
    def fn(*args):
        return evaluate(eqns, in_values, args, out_values, consts)

    return jax.make_jaxpr(fn)(*[aval_of(v) for v in in_values])


def jaxpr_as_fun(closed):
    return jcore.jaxpr_as_fun(closed)


# Control flow whose bodies are planned on their own (pipeline.build) and bound again with the
# stitched bodies (stitcher.make_runner): the params holding a ClosedJaxpr, or a tuple of them.
_BODY_PARAMS = {"scan": ("jaxpr",), "while": ("cond_jaxpr", "body_jaxpr"), "cond": ("branches",)}


def bodies(eqn: Eqn) -> list[tuple[tuple[str, int], Any]]:
    """(key, ClosedJaxpr) for each body of a control-flow equation; key = (param, branch index).
    (jax 0.11 merged the classes, `ClosedJaxpr = Jaxpr`, the constants carried by the Jaxpr: a
    scan's body there is such a Jaxpr and is planned like any other; checked on the GPU machine's
    jax 0.11.2.)"""
    out = []
    for name in _BODY_PARAMS.get(eqn.primitive.name, ()):
        val = eqn.params.get(name)
        items = val if isinstance(val, (tuple, list)) else (val,)
        for i, closed in enumerate(items):
            if isinstance(closed, jcore.ClosedJaxpr):
                out.append(((name, i), closed))
    return out


def scan_parts(eqn: Eqn) -> tuple[int, int] | None:
    """(consts, carries) among a scan's operands, read off the types (the params that record them
    differ between jax versions: num_consts and num_carry, or ft_in): per-step operands and results
    are stacked (one more axis, of the scan's length), consts and carries are not, and the carries
    are the body's first results. None if the types do not say."""
    try:
        return _scan_parts(eqn)
    except Exception:  # noqa: BLE001 - symbolic sizes that cannot be compared, params of another form
        return None


def _scan_parts(eqn: Eqn) -> tuple[int, int] | None:
    body = eqn.params["jaxpr"].jaxpr
    length = int(eqn.params["length"])
    ins, outs = [tuple(v.aval.shape) for v in body.invars], [tuple(v.aval.shape) for v in body.outvars]
    outer_in = [a.shape if isinstance(a, ir.Value) else () for a in eqn.inputs]
    outer_out = [v.shape for v in eqn.outputs]
    if len(ins) != len(outer_in) or len(outs) != len(outer_out):
        return None
    stacked_in = [o == (length, *i) for o, i in zip(outer_in, ins)]
    stacked_out = [o == (length, *i) for o, i in zip(outer_out, outs)]
    carry = stacked_out.index(True) if True in stacked_out else len(outs)
    xs = len(ins) - (stacked_in.index(True) if True in stacked_in else len(ins))
    consts = len(ins) - xs - carry
    if (consts < 0 or not all(stacked_in[consts + carry:]) or any(stacked_in[:consts + carry])
            or not all(stacked_out[carry:]) or any(stacked_out[:carry])
            or ins[consts:consts + carry] != outs[:carry]):
        return None
    known = (eqn.params.get("num_consts"), eqn.params.get("num_carry"))
    if None not in known and tuple(int(k) for k in known) != (consts, carry):
        return None
    return consts, carry


def scan_body(eqn: Eqn) -> ir.Graph | None:
    """A scan's step as a graph over its (consts, carries, xs[t]) inputs, returning (carries, ys[t]);
    None when it captures arrays of its own."""
    graph, _, consts, _ = _flatten(eqn.params["jaxpr"])  # (a ClosedJaxpr: jax 0.10's, and 0.11's Jaxpr)
    return None if consts else graph


def with_bodies(eqn: Eqn, new: dict) -> Eqn:
    """`eqn` with the bodies named in `new` ({key: ClosedJaxpr}, keys as from `bodies`) replaced."""
    params = dict(eqn.params)
    for name in _BODY_PARAMS.get(eqn.primitive.name, ()):
        val = params[name]
        if isinstance(val, (tuple, list)):
            params[name] = type(val)(new.get((name, i), c) for i, c in enumerate(val))
        else:
            params[name] = new.get((name, 0), val)
    return dataclasses.replace(eqn, params=params)


def in_avals(closed) -> list:
    """A closed jaxpr's inputs as ShapeDtypeStructs (to trace a body on its own)."""
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.in_avals]
