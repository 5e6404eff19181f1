"""Transformation rules for the `stitch` primitive: transform the region's jaxpr, then stitch it again.

Built like `pjit`'s rules. A region carries its jaxpr and the `Context` it was planned in, so
`jax.grad`, `jax.vmap` and `jax.linearize` of a stitched function give functions that are planned
and stitched in turn, instead of falling back to the region's primitives:

- JVP: the region's JVP is unzipped into a *known* part (primal results, and the residuals the
  tangents need) and a *linear* part (residuals, tangents -> output tangents), each stitched on its
  own. Kept apart, no kernel mixes known and unknown inputs, so JAX's partial evaluation leaves
  the primal kernels in the forward pass and stages only linear kernels. Residuals are the inputs,
  the results and reduced values; full-size intermediates are recomputed in the linear part (a
  memory-bound kernel re-reads its inputs faster than it could write and read them back).
- Transpose: the linear region's transpose (its VJP, residuals held fixed).
- Batching: the region under `jax.vmap`.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from jax.interpreters import ad, batching

from ..core import ir
from ..frontend import trace as trace_mod
from .families import sample_size
from .primitive import stitch_p
from .stitcher import restitch_or_xla


@dataclasses.dataclass(frozen=True, eq=False)
class Unzipped:
    """A traced function split by dependence on its unknown inputs (see `unzip`)."""

    traced: trace_mod.Traced
    known_eqns: tuple[trace_mod.Eqn, ...]
    linear_eqns: tuple[trace_mod.Eqn, ...]  # in program order, with the known ones it recomputes
    residuals: tuple[ir.Value, ...]         # known values the linear part reads
    unknown_inputs: tuple[bool, ...]
    unknown_outputs: tuple[bool, ...]

    def known(self, *known_args):
        """Known inputs -> (known outputs, residuals)."""
        g = self.traced.graph
        ins = [v for v, u in zip(g.inputs, self.unknown_inputs) if not u]
        outs = [a for a, u in zip(g.outputs, self.unknown_outputs) if not u] + list(self.residuals)
        return trace_mod.evaluate(self.known_eqns, ins, known_args, outs, self.traced.consts)

    def linear(self, *res_and_unknown_args):
        """(residuals, unknown inputs) -> unknown outputs."""
        g = self.traced.graph
        ins = list(self.residuals) + [v for v, u in zip(g.inputs, self.unknown_inputs) if u]
        outs = [a for a, u in zip(g.outputs, self.unknown_outputs) if u]
        return trace_mod.evaluate(self.linear_eqns, ins, res_and_unknown_args, outs, self.traced.consts)


def unzip(traced: trace_mod.Traced, unknown_inputs: Sequence[bool]) -> Unzipped:
    """Split `traced` into the equations computable from the known inputs and those that depend on
    the unknown ones. A known value the unknown side reads is a residual if it is an input, a
    result or smaller than the largest values; otherwise its producers are computed again there."""
    graph = traced.graph
    unknown = {v.id for v, u in zip(graph.inputs, unknown_inputs) if u}
    is_unknown = []
    for e in traced.eqns:
        u = any(isinstance(a, ir.Value) and a.id in unknown for a in e.inputs)
        is_unknown.append(u)
        if u:
            unknown.update(o.id for o in e.outputs)
    producer = {o.id: i for i, e in enumerate(traced.eqns) for o in e.outputs}
    full = max((sample_size(v.size) for e in traced.eqns for v in e.outputs), default=0)
    kept = {v.id for v in graph.inputs} | {a.id for a in graph.outputs if isinstance(a, ir.Value)}

    recompute, residuals, seen = set(), [], set()

    def need(a):
        if not isinstance(a, ir.Value) or a.id in unknown or a.id in seen or a.id in traced.consts:
            return
        seen.add(a.id)
        if a.id in kept or a.id not in producer or sample_size(a.size) < full:
            residuals.append(a)
            return
        i = producer[a.id]
        recompute.add(i)
        for b in traced.eqns[i].inputs:
            need(b)

    for i, e in enumerate(traced.eqns):
        if is_unknown[i]:
            for a in e.inputs:
                need(a)
    unknown_outputs = tuple(isinstance(a, ir.Value) and a.id in unknown for a in graph.outputs)
    known_eqns = tuple(e for e, u in zip(traced.eqns, is_unknown) if not u)
    linear_eqns = tuple(e for i, e in enumerate(traced.eqns) if is_unknown[i] or i in recompute)
    return Unzipped(traced, known_eqns, linear_eqns, tuple(residuals),
                    tuple(bool(u) for u in unknown_inputs), unknown_outputs)


def _jvp(primals, tangents, *, jaxpr, launch, context):
    if any(e.primitive.name in _LOOPS for e in jaxpr.jaxpr.eqns):
        return _jvp_of_loop(primals, tangents, jaxpr, context)
    region = trace_mod.jaxpr_as_fun(jaxpr)
    nonzero, live_tangents = _live(primals, tangents)
    n = len(primals)

    def jvp_fun(*args):
        p_out, t_out = jax.jvp(region, list(args[:n]), _full(args[:n], nonzero, args[n:]))
        return [*p_out, *t_out]

    args = [*primals, *live_tangents]
    traced = trace_mod.trace(jvp_fun, args, trace_mod.positional_tree(args))
    parts = unzip(traced, [False] * n + [True] * len(live_tangents))
    known = restitch_or_xla(parts.known, list(primals), context, "JVP (primal part)")
    n_known = sum(not u for u in parts.unknown_outputs)
    known_outs, residuals = known[:n_known], known[n_known:]
    linear_outs = (restitch_or_xla(parts.linear, [*residuals, *live_tangents], context, "JVP (linear part)")
                   if any(parts.unknown_outputs) else [])
    ko, lo = iter(known_outs), iter(linear_outs)
    outs = [next(lo) if u else next(ko) for u in parts.unknown_outputs]
    return outs[:len(jaxpr.out_avals)], outs[len(jaxpr.out_avals):]


# Equations `unzip` cannot split: one loop computes primals and tangents together.
_LOOPS = ("scan", "while", "cond")


def _jvp_of_loop(primals, tangents, jaxpr, context):
    """The JVP of a region holding a whole loop (a persistent scan, plan/scan.py): `jax.linearize`
    splits the loop into a primal loop that saves residuals and a linear loop over the tangents,
    each stitched on its own (`unzip` works on whole equations, and the loop is one)."""
    region = trace_mod.jaxpr_as_fun(jaxpr)
    nonzero, live = _live(primals, tangents)
    tree = []

    def known(*ps):
        out, lin = jax.linearize(region, *ps)
        residuals, t = jax.tree.flatten(lin)
        tree.append(t)
        return [*out, *residuals]

    got = restitch_or_xla(known, list(primals), context, "JVP (primal part)")
    n_out = len(jaxpr.out_avals)
    outs, residuals = got[:n_out], got[n_out:]

    def linear(*args):
        res, ts = args[:len(residuals)], args[len(residuals):]
        return list(jax.tree.unflatten(tree[0], list(res))(*_full(primals, nonzero, ts)))

    return outs, restitch_or_xla(linear, [*residuals, *live], context, "JVP (linear part)")


def _live(primals, tangents) -> tuple[list[bool], list]:
    """(which tangents are nonzero floats, those tangents): the others are passed as zeros."""
    nonzero = [type(t) is not ad.Zero and _inexact(p) for p, t in zip(primals, tangents)]
    return nonzero, [t for t, nz in zip(tangents, nonzero) if nz]


def _full(primals, nonzero, live) -> list:
    """A tangent for every primal: the live ones in order, zeros (float0 for integers) elsewhere."""
    ts = iter(live)
    return [next(ts) if nz else _zeros(p) for p, nz in zip(primals, nonzero)]


def _inexact(x) -> bool:
    return jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)


def _zeros(p):
    """A zero tangent for primal `p` (float0 for integer and boolean primals)."""
    if not _inexact(p):
        return np.zeros(p.shape, jax.dtypes.float0)
    return jax.numpy.zeros(p.shape, p.dtype)


def _transpose(cts, *args, jaxpr, launch, context):
    linear = [ad.is_undefined_primal(a) for a in args]
    fixed = [a for a, lin in zip(args, linear) if not lin]
    lin_avals = [a.aval for a, lin in zip(args, linear) if lin]
    # outputs that carry a cotangent (floats, not symbolic zeros)
    used = [type(c) is not ad.Zero and c is not None and _inexact(o) for c, o in zip(cts, jaxpr.out_avals)]
    if not any(used):
        return [ad.Zero(a.aval) if lin else None for a, lin in zip(args, linear)]
    region = trace_mod.jaxpr_as_fun(jaxpr)
    k = len(fixed)

    def backward(*vals):
        held, ct = vals[:k], vals[k:]

        def forward(*lin_args):
            it_l, it_h = iter(lin_args), iter(held)
            outs = region(*[next(it_l) if lin else next(it_h) for lin in linear])
            return [o for o, u in zip(outs, used) if u]

        # the transpose of a linear function is its VJP at any point; at zeros, the forward
        # computation the backward pass does not read is dead code, which tracing drops
        _, vjp = jax.vjp(forward, *[_zeros(a) for a in lin_avals])
        return list(vjp(list(ct)))

    ct_used = [c for c, u in zip(cts, used) if u]
    ct_in = iter(restitch_or_xla(backward, [*fixed, *ct_used], context, "transpose"))
    return [next(ct_in) if lin else None for lin in linear]


def _batch(args, dims, *, jaxpr, launch, context):
    axes = tuple(d if isinstance(d, int) else None for d in dims)  # not mapped: None
    fun = jax.vmap(trace_mod.jaxpr_as_fun(jaxpr), in_axes=axes)
    outs = restitch_or_xla(lambda *a: list(fun(*a)), list(args), context, "batching")
    return outs, [0] * len(outs)


ad.primitive_jvps[stitch_p] = _jvp
ad.primitive_transposes[stitch_p] = _transpose
batching.primitive_batchers[stitch_p] = _batch
