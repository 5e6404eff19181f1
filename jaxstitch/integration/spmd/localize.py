"""A region as a function of one device's shards, to be planned and stitched for the local shapes.

Every op is bound again with the sizes it names made local (a broadcast's or reshape's shape, an
iota's, a whole-dimension slice's limits), an iota along a split factor counts from the shard's
offset, a captured constant is cut to the shard, and a reduction over a split factor is completed
by the collective that XLA would use (psum, pmax, pmin over the mesh axes that split it).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import numpy as np

from ...core import ir
from ...frontend import trace as trace_mod
from .factors import COLLECTIVE_OF, Factors
from .placement import local_shape

_COLLECTIVES = {"psum": jax.lax.psum, "pmax": jax.lax.pmax, "pmin": jax.lax.pmin}


def local_function(traced: trace_mod.Traced, factors: Factors, axes, mesh: Mapping[str, int]):
    """`traced` (a region over global shapes) as a function of local shards, placed by `axes`."""
    ops = traced.graph.ops
    known = dict(factors.dims)

    def local(v: ir.Value) -> tuple[int, ...]:
        return local_shape(factors, axes, v, mesh)

    def dim_axes(v: ir.Value, d: int) -> tuple[str, ...]:
        return tuple(a for f in factors.of(v)[d] for a in axes[f])

    def offset(v: ir.Value, d: int):
        """Where this device's tile of dimension d of v starts (a traced int32)."""
        index = jax.numpy.int32(0)
        for a in dim_axes(v, d):
            index = index * mesh[a] + jax.lax.axis_index(a)
        return index * local(v)[d]

    def read(env, a):
        return trace_mod.const_array(a) if isinstance(a, ir.Const) else env[a.id]

    def run(*args):
        env = {v.id: a for v, a in zip(traced.graph.inputs, args)}
        for vid, c in traced.consts.items():
            v = ir.Value(vid, tuple(np.shape(c)), "float32")  # (only its id and shape are read)
            split = vid in known and any(dim_axes(v, d) for d in range(np.ndim(c)))
            env[vid] = jax.lax.dynamic_slice(jax.numpy.asarray(c), [offset(v, d) for d in range(np.ndim(c))],
                                             local(v)) if split else c
        for eqn, op in zip(traced.eqns, ops):
            outs = trace_mod.bind_eqn(_with_params(eqn, _local_params(op, local)), [read(env, a) for a in eqn.inputs])
            outs = [_complete(op, o, dim_axes) for o in outs]
            if op.prim == "iota" and dim_axes(op.outputs[0], op.param("dimension")):
                outs = [outs[0] + offset(op.outputs[0], op.param("dimension")).astype(outs[0].dtype)]
            for v, o in zip(eqn.outputs, outs):
                env[v.id] = o
        return [read(env, a) for a in traced.graph.outputs]

    return run


def _local_params(op: ir.Op, local) -> dict:
    """The params of `op` that name sizes, made local."""
    out = local(op.outputs[0])
    if op.prim == "broadcast_in_dim":
        return {"shape": out, "sharding": None}
    if op.prim == "reshape":
        return {"new_sizes": out, "sharding": None}
    if op.prim == "iota":
        return {"shape": out, "sharding": None}
    if op.prim == "slice":
        x = op.inputs[0]
        limits = tuple(local(x)[i] if lim == x.shape[i] and op.param("start_indices")[i] == 0 else lim
                       for i, lim in enumerate(op.param("limit_indices")))
        return {"limit_indices": limits}
    if op.prim == "dynamic_slice":
        x = op.inputs[0]
        return {"slice_sizes": tuple(local(x)[i] if s == x.shape[i] else s
                                     for i, s in enumerate(op.param("slice_sizes")))}
    return {}


def _with_params(eqn: trace_mod.Eqn, changes: dict) -> trace_mod.Eqn:
    if not changes:
        return eqn
    params = dict(eqn.params)
    params.update({k: v for k, v in changes.items() if k in params})
    return dataclasses.replace(eqn, params=params)


def _complete(op: ir.Op, out, dim_axes):
    """A reduction's per-shard partial, completed over the mesh axes that split its reduced axes."""
    if op.prim not in COLLECTIVE_OF:
        return out
    x = op.inputs[0]
    names = tuple(a for d in op.param("axes") for a in dim_axes(x, d))
    if not names:
        return out
    return _COLLECTIVES[COLLECTIVE_OF[op.prim]](out, names)

