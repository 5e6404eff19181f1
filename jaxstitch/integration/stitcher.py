"""Rebuild a traced function with its stitched regions replaced by `stitch` primitives."""
from __future__ import annotations

import dataclasses
import heapq
import logging
import math

import jax
import jax.numpy as jnp

from ..core import ir
from ..core.config import Config
from ..core.targets import Target
from ..driver.program import Compiled, Program
from ..frontend import trace as trace_mod
from ..graph import positions, recompute
from ..kernels import cache, nvrtc, xla_kernel
from ..lowering.codegen import KERNEL_NAME
from ..plan.remote import RemotePlan
from . import families, ffi
from .primitive import Launch, stitch

log = logging.getLogger("jaxstitch")


@dataclasses.dataclass(frozen=True)
class Context:
    """What planning a region again needs (after `jax.grad` or `jax.vmap` transformed it, see
    transforms.py): the GPU and the configuration. Every `stitch` carries it."""

    target: Target
    cfg: Config


def _launch(c: Compiled, poison: bool, donated: frozenset[int] = frozenset()) -> Launch:
    m = c.plan.kernel.mapping
    launch = Launch(c.key, c.cubin, KERNEL_NAME, m.grid, m.block, m.smem_bytes, m.cooperative,
                    c.plan.kernel.workspace_bytes, poison, rows=getattr(m, "n_rows", None) or 0,
                    aliases=_aliases(c, poison, donated))
    if c.rows_source is None:
        return launch
    buffer, row_elems = c.rows_source  # (a family's member: rows and grid follow the buffers)
    launch = dataclasses.replace(launch, grid=m.grid_cap, rows_buffer=buffer, row_elems=row_elems,
                                 rows_per_block=m.rows_per_block, splits=m.splits)
    if not c.variants:
        return launch
    # One workspace for whichever kernel runs: the largest; a kernel without one leaves it out.
    alts = tuple(_alternative(below, v) for below, v in c.variants)
    ws = max([launch.workspace_bytes] + [v.plan.kernel.workspace_bytes for _, v in c.variants])
    return dataclasses.replace(launch, workspace_bytes=ws, alternatives=alts, buffers=_buffers(c))


def _as_xla_kernel(c: Compiled, launch: Launch, context: Context) -> Launch:
    """`launch` as XLA's own kernel call where the tuning asks for it and the kernel allows it
    (kernels/xla_kernel.py); an NVRTC failure keeps the launcher."""
    if not context.cfg.tuning.xla_kernels:
        return launch
    why = xla_kernel.unsupported(launch, remote=isinstance(c.plan.kernel, RemotePlan))
    if why is None:
        try:
            source = xla_kernel.fixed_rows_source(c.source, launch.rows)
            ptx = cache.get_ptx(source, context.target.arch, context.cfg.cache_dir)
            return dataclasses.replace(launch, ptx=xla_kernel.for_driver(ptx, xla_kernel.driver_cuda_version()))
        except nvrtc.CompileError as e:
            why = f"NVRTC: {str(e).splitlines()[0]}"
    log.info("region %d keeps the launcher: %s", c.plan.region.id, why)
    return launch


def _aliases(c: Compiled, poison: bool, donated: frozenset[int]) -> tuple[tuple[int, int], ...]:
    """The kernel's in-place pairs (plan/remote.py in_place) over `donated` inputs: XLA would copy
    any other argument first, to keep it (a launch per buffer). None when poisoning: it fills the
    results before the launch, over the arguments they share."""
    if poison:
        return ()
    if not isinstance(c.plan.kernel, RemotePlan):  # (only a remote kernel writes over its inputs)
        return ()
    r = c.plan.region
    return tuple((i, o) for i, o in c.plan.kernel.aliases if r.inputs[i].id in donated)


def _buffers(c: Compiled) -> int:
    """Pointers the kernel takes before its row count: the region's inputs and outputs, then its
    workspace if it crosses grid barriers."""
    r = c.plan.region
    return len(r.inputs) + len(r.outputs) + int(c.plan.kernel.mapping.cooperative)


def _alternative(below_rows: int, v: Compiled) -> ffi.Alternative:
    m = v.plan.kernel.mapping
    return ffi.Alternative(below_rows, v.cubin, v.key, m.grid_cap, m.block, m.smem_bytes, m.cooperative,
                           m.rows_per_block, m.splits, _buffers(v))


def _schedule(program: Program):
    """Equations and stitched regions in a dependency order (Kahn's algorithm, program order first)."""
    eqns = program.traced.eqns
    node_of = {}
    nodes = {}
    for c in program.regions:
        if c.stitched:
            r = c.plan.region
            for op in r.ops:
                if op.index not in r.recomputed:  # (those also run outside, for other consumers)
                    node_of[op.index] = ("r", r.id)
            nodes[("r", r.id)] = c
    for i in range(len(eqns)):
        node_of.setdefault(i, ("e", i))
        nodes.setdefault(node_of[i], None)
    producer = {o.id: node_of[i] for i, e in enumerate(eqns) for o in e.outputs}
    deps = {n: set() for n in nodes}
    users = {n: set() for n in nodes}
    first = {}
    for i, e in enumerate(eqns):
        n = node_of[i]
        first.setdefault(n, i)
        for a in e.inputs:
            if isinstance(a, ir.Value) and a.id in producer and producer[a.id] != n:
                deps[n].add(producer[a.id])
                users[producer[a.id]].add(n)
    ready = [(first[n], n) for n in nodes if not deps[n]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for u in users[n]:
            deps[u].discard(n)
            if not deps[u]:
                heapq.heappush(ready, (first[u], u))
    if len(order) != len(nodes):
        raise RuntimeError("jaxstitch: the region graph has a cycle (a partitioning bug)")
    return [(n, nodes[n]) for n in order]


def make_runner(program: Program, context: Context, donated: frozenset[int] = frozenset()):
    """A function of the dynamic flat arguments returning the flat outputs; `donated`: positions
    of arguments whose buffers the caller donates (kernels may write their results over them)."""
    traced = program.traced
    schedule = _schedule(program)
    region_fns = {}
    poison = context.cfg.poison
    donated_ids = frozenset(traced.graph.inputs[k].id for k in donated)
    for (kind, rid), c in schedule:
        if kind == "r":
            r = c.plan.region
            region_eqns = [traced.eqns[op.index] for op in r.ops]
            closed = trace_mod.region_jaxpr(region_eqns, r.inputs, r.outputs, traced.consts)
            launch = _as_xla_kernel(c, _launch(c, poison, donated_ids), context)
            region_fns[rid] = (r, closed, launch, c.xla_below)

    eqns = {i: _with_stitched_bodies(traced.eqns[i], program, i, context)
            for (kind, i), _ in schedule if kind == "e"}

    producer = {o.id: op for op in traced.graph.ops for o in op.outputs}

    def run(*flat_args):
        env = dict(traced.consts)
        for v, a in zip(traced.graph.inputs, flat_args):
            env[v.id] = a

        def read(a):
            if isinstance(a, ir.Const):
                return trace_mod.const_array(a)
            if a.id not in env and positions.positional(a, producer):
                # (a mask computed from positions alone, which no kernel wrote: recompute.py)
                for op in positions.cone(a, producer):
                    outs = trace_mod.bind_eqn(traced.eqns[op.index], [read(x) for x in op.inputs])
                    env.update((v.id, o) for v, o in zip(op.outputs, outs))
            elif a.id not in env:
                # (a gather's operand, or a value a declined region reads: a cheap chain of a
                # region's inputs, which no kernel wrote: recompute._drop_unread; its ops run
                # here, for XLA to fuse into their reader)
                op = producer[a.id]
                if not recompute.rebuildable(op):
                    raise RuntimeError(f"jaxstitch: {op.prim}'s result was not written (a partitioning bug)")
                outs = trace_mod.bind_eqn(traced.eqns[op.index], [read(x) for x in op.inputs])
                env.update((v.id, o) for v, o in zip(op.outputs, outs))
            return env[a.id]

        for (kind, idx), _ in schedule:
            if kind == "e":
                eqn = eqns[idx]
                outs = trace_mod.bind_eqn(eqn, [read(a) for a in eqn.inputs])
                for v, o in zip(eqn.outputs, outs):
                    env[v.id] = o
            else:
                r, closed, launch, xla_below = region_fns[idx]
                args = [read(v) for v in r.inputs]
                outs = stitch(args, jaxpr=closed, launch=launch, context=context) if not xla_below else \
                    _ours_or_xla(args, closed, launch, xla_below, context)
                for v, o in zip(r.outputs, outs):
                    env[v.id] = o
        return [read(a) for a in traced.graph.outputs]

    return run


def _ours_or_xla(args, closed, launch: Launch, bound: int, context: Context) -> list:
    """A family member's results: its jaxpr (XLA's kernels) when there are fewer rows than `bound`,
    else our kernel. With symbolic sizes this is a conditional on the row count, which XLA resolves
    when it compiles the program for actual sizes."""
    shape = ([a.shape for a in args] + [o.shape for o in closed.out_avals])[launch.rows_buffer]
    rows = math.prod(shape) // launch.row_elems

    def ours(*a):
        return stitch(list(a), jaxpr=closed, launch=launch, context=context)

    def theirs(*a):
        return trace_mod.jaxpr_as_fun(closed)(*a)

    if isinstance(rows, int):
        return (theirs if rows < bound else ours)(*args)
    return jax.lax.cond(jnp.asarray(rows) < bound, theirs, ours, *args)


def _with_stitched_bodies(eqn, program: Program, index: int, context: Context):
    """A control-flow equation with each body that has stitched regions rebuilt around them."""
    new = {}
    for i, key, body in program.bodies:
        if i == index and body.stitched:
            closed = dict(trace_mod.bodies(eqn))[key]
            new[key] = jax.make_jaxpr(make_runner(body, context))(*trace_mod.in_avals(closed))
    return trace_mod.with_bodies(eqn, new) if new else eqn


def restitch(fun, args, context: Context) -> list:
    """`fun(*args)` (flat arrays in, a flat list out) planned and stitched like `jaxstitch.jit`'s
    body: for a region after a transformation (transforms.py) or for one device's shards (integration/spmd/)."""
    program = families.build_any(fun, list(args), trace_mod.positional_tree(args), context.target, context.cfg)
    return list(make_runner(program, context)(*args))


def restitch_or_xla(fun, args, context: Context, what: str) -> list:
    """restitch(fun, args), or on a failure in planning it, fun's own primitives (XLA), logged: a
    region planned again (after a transformation, or for one device's shards) must never break the
    program."""
    try:
        return restitch(fun, args, context)
    except Exception as e:  # noqa: BLE001
        log.warning("a region's %s is left to XLA: %s: %s", what, type(e).__name__, e)
        return list(fun(*args))
