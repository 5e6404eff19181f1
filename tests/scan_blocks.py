"""A CPU model of what a persistent scan kernel computes (plan/scan.py), block by block: each block
runs the scan's body with jax's own primitives on its rows only (batched values cut to them, whole
values whole, sums over rows starting from zero), and the blocks' sums over rows meet after the
last step. Agreeing with jax.jit on the whole program checks the plan's reading of the body (which
values keep rows apart, which are sums over rows), not the generated CUDA."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxstitch.core import ir
from jaxstitch.graph import partition
from jaxstitch.frontend import trace as trace_mod
from jaxstitch.plan import scan as S


def run_with_blocks(fn, args, target):
    """fn(*args) with each scan that plans for `target` evaluated as its blocks would (others by
    jax); returns (flat outputs, number of scans modelled)."""
    traced = trace_mod.trace(fn, args, trace_mod.positional_tree(args))
    env = dict(traced.consts)
    env.update((v.id, a) for v, a in zip(traced.graph.inputs, args))

    def read(a):
        return trace_mod.const_array(a) if isinstance(a, ir.Const) else env[a.id]

    modelled = 0
    for op, eqn in zip(traced.graph.ops, traced.eqns):
        ins = [read(a) for a in eqn.inputs]
        plan = _plan(op, eqn, target) if op.prim == "scan" else None
        outs = _blocks(plan, eqn, ins) if plan is not None else trace_mod.bind_eqn(eqn, ins)
        modelled += plan is not None
        env.update((v.id, o) for v, o in zip(eqn.outputs, outs))
    return [read(a) for a in traced.graph.outputs], modelled


def _plan(op, eqn, target):
    body = trace_mod.scan_body(eqn)
    region = partition.Region(0, (op,), tuple(dict.fromkeys(a for a in op.inputs if isinstance(a, ir.Value))),
                              op.outputs)
    try:
        return S.plan_scan(region, body, target)[0]
    except S.Unplannable:
        return None


def _blocks(plan: S.ScanPlan, eqn, operands):
    _, body_eqns, _, _ = trace_mod._flatten(eqn.params["jaxpr"])
    m, body = plan.mapping, plan.body
    nc, ncar = plan.num_consts, plan.num_carry
    carries = [v for v, _ in plan.carries]
    length = m.length
    order = range(length - 1, -1, -1) if plan.reverse else range(length)
    final = [None] * ncar
    ys = [np.zeros(v.shape, np.dtype(v.dtype) if v.dtype != "bfloat16" else jnp.bfloat16)
          for v in eqn.outputs[ncar:]]
    ys = [np.asarray(y) for y in ys]
    for b in range(m.grid):
        r0 = b * m.rows
        n = min(m.rows, m.batch - r0)
        cut = _Cut(plan, r0, n)
        state = [jnp.zeros(v.shape, operands[nc + j].dtype) if plan.kind(v).kind == S.PARTIAL
                 else cut(v, operands[nc + j]) for j, v in enumerate(carries)]
        consts = [cut(v, a) for v, a in zip(body.inputs[:nc], operands[:nc])]
        for t in order:
            xs = [cut(v, a[t]) for v, a in zip(plan.xs, operands[nc + ncar:])]
            outs = _step(plan, body_eqns, cut, [*consts, *state, *xs])
            state = outs[:ncar]
            for y, got, into in zip(plan.ys, outs[ncar:], ys):
                cut.put(y, got, into, t)
        for j, v in enumerate(carries):
            k = plan.kind(v).kind
            if k == S.PARTIAL:
                final[j] = (operands[nc + j] if final[j] is None else final[j]) + state[j]
            elif k == S.BATCHED:
                if final[j] is None:
                    final[j] = np.array(operands[nc + j])
                cut.put(v, state[j], final[j], None)
            elif b == 0:
                final[j] = state[j]
    return [jnp.asarray(f) for f in final] + [jnp.asarray(y) for y in ys]


def _step(plan, body_eqns, cut, inputs):
    env = {v.id: a for v, a in zip(plan.body.inputs, inputs)}

    def read(a):
        return trace_mod.const_array(a) if isinstance(a, ir.Const) else env[a.id]

    for op, eqn in zip(plan.body.ops, body_eqns):
        outs = trace_mod.bind_eqn(dataclasses.replace(eqn, params=cut.params(op, eqn.params)),
                                  [read(a) for a in eqn.inputs])
        env.update((v.id, o) for v, o in zip(eqn.outputs, outs))
    return [read(a) for a in plan.body.outputs]


class _Cut:
    """One block's view: its rows of batched values, in shape params too."""

    def __init__(self, plan, r0, n):
        self.plan, self.r0, self.n = plan, r0, n

    def axis(self, v: ir.Value) -> int | None:
        return self.plan.row_axis(v)

    def __call__(self, v: ir.Value, a):
        ax = self.axis(v)
        return a if ax is None else jnp.take(a, jnp.arange(self.r0, self.r0 + self.n), axis=ax)

    def put(self, v, got, into: np.ndarray, t):
        """Writes the block's part of `v` (at step `t` of a stacked result) into `into`."""
        ax = self.axis(v) if isinstance(v, ir.Value) else None
        index = [slice(None)] * (into.ndim - (t is not None))
        if ax is None and self.r0 != 0:
            return  # (a whole value: block 0 writes it)
        if ax is not None:
            index[ax] = slice(self.r0, self.r0 + self.n)
        into[tuple(([t] if t is not None else []) + index)] = np.asarray(got)

    def local(self, v: ir.Value) -> tuple[int, ...]:
        return S.cut(v.shape, self.axis(v), self.n)

    def params(self, op, params: dict) -> dict:
        out = op.outputs[0]
        if op.prim == "broadcast_in_dim":
            return {**params, "shape": self.local(out)}
        if op.prim == "reshape":
            return {**params, "new_sizes": self.local(out)}
        if op.prim == "slice" and self.axis(op.inputs[0]) is not None:
            ax = self.axis(op.inputs[0])
            limits = list(params["limit_indices"])
            limits[ax] = self.n
            return {**params, "limit_indices": tuple(limits)}
        return params
