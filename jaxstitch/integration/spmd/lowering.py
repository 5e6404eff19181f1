"""The `stitch` primitive's lowering under a mesh of several devices.

With one device (or inside `shard_map`, where every mesh axis is manual and the region was traced
with local shapes) the kernel runs as planned. Otherwise the region goes to XLA's partitioner as a
`custom_partitioning` call: its Shardy rule names the factors of the region's inputs and results
(factors.py), so sharding propagates through the region as through the ops it holds, and the
partition callback places the factors on the mesh (placement.py) and plans the region again for
one device's shards, with collectives completing reductions over a split factor (localize.py).
"""
from __future__ import annotations

import dataclasses
import functools
import logging

from jax.experimental.custom_partitioning import ArrayMapping, CompoundFactor, SdyShardingRule, custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from ...core import ir
from ...frontend import trace as trace_mod
from .. import primitive
from ..jax_internals import requires_devices_during_lowering
from ..stitcher import restitch_or_xla
from .factors import Factors, analyze
from .localize import local_function
from .placement import Placement, place

log = logging.getLogger("jaxstitch")


def is_partitioned(ctx) -> bool:
    """True when XLA's SPMD partitioner will split this lowering over several devices."""
    ac = ctx.module_context.axis_context
    if isinstance(ac, mlir.ShardingContext):
        return ac.num_devices > 1
    if isinstance(ac, mlir.SPMDAxisContext):
        return set(ac.manual_axes) != set(ac.mesh.axis_names)
    return False


@functools.lru_cache(maxsize=512)
def region_of(jaxpr) -> tuple[trace_mod.Traced, Factors]:
    traced = trace_mod.from_closed(jaxpr)
    return traced, analyze(traced.graph)


def partitioned(rule):
    """`rule` (a lowering of `stitch`), through custom_partitioning when the program is partitioned."""

    def lower(ctx, *args, jaxpr, launch, context):
        if launch is None or not args or not is_partitioned(ctx):  # (no inputs: nothing to split)
            return rule(ctx, *args, jaxpr=jaxpr, launch=launch, context=context)
        return mlir.lower_fun(_partitionable(jaxpr, launch, context), multiple_results=True)(ctx, *args)

    return lower


def _partitionable(jaxpr, launch, context):
    traced, factors = region_of(jaxpr)
    graph = traced.graph

    def whole(*args):
        return tuple(primitive.stitch(list(args), jaxpr=jaxpr, launch=launch, context=context))

    def placement(mesh, arg_shapes, result_shape=()) -> Placement:
        specs = [_axes_of(s.sharding.spec, len(s.shape)) for s in arg_shapes]
        results = result_shape if isinstance(result_shape, (list, tuple)) else [result_shape]
        out_specs = [_axes_of(s.sharding.spec, len(s.shape)) if hasattr(getattr(s, "sharding", None), "spec")
                     else ((),) * len(s.shape) for s in results]
        p = place(factors, graph.inputs, specs, graph.outputs, dict(mesh.shape), out_specs)
        for why in p.dropped:
            log.info("a sharded region gathers %s", why)
        return p

    def infer(mesh, arg_shapes, result_shape):
        return _shardings(mesh, placement(mesh, arg_shapes).outputs)

    def partition(mesh, arg_shapes, result_shape):
        p = placement(mesh, arg_shapes, result_shape)
        if not p.sharded:
            fun = whole
        else:
            local = local_function(traced, factors, p.axes, dict(mesh.shape))
            shard_context = for_shards(context)

            def fun(*args):
                return tuple(restitch_or_xla(local, list(args), shard_context, "shard"))

        return mesh, fun, _shardings(mesh, p.outputs), _shardings(mesh, p.inputs)

    fn = custom_partitioning(whole)
    fn.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=sharding_rule(factors, graph))
    return lambda *args: list(fn(*args))


# A shard's region is stitched where its estimate does not lose (1.0x): the program's plan chose it
# at the global shapes, where the cost model's 1.15x margin for its error was asked; planned again
# at a shard's shapes, the same rows halved over two devices estimated below that margin (launches
# weigh more there) and went back to XLA (a data-parallel BERT step: a region of 1.05x at its
# shard's shapes, stitched on one device).
SHARD_MIN_GAIN_PCT = 100


def for_shards(context):
    """`context` for planning a region again at one device's shards (a min_gain_pct given in
    JAXSTITCH_TUNE stands)."""
    tuning = context.cfg.tuning
    if tuning.min_gain_pct is not None:
        return context
    cfg = dataclasses.replace(context.cfg, tuning=dataclasses.replace(tuning, min_gain_pct=SHARD_MIN_GAIN_PCT))
    return dataclasses.replace(context, cfg=cfg)


def sharding_rule(factors: Factors, graph: ir.Graph) -> SdyShardingRule:
    """The region's factors as Shardy's rule: one name per factor, a compound for a merged dimension,
    fresh names for size-1 dimensions; pinned factors need replication."""
    sizes = {}  # name -> size, for every factor and fresh name
    whole, compound = set(), set()

    def name(f, seen):
        n = f"f{f}" if f not in seen else f"u{len(sizes)}"  # (a factor twice in a value: pinned)
        sizes[n] = factors.sizes[f]
        return n

    def mapping(v):
        if not isinstance(v, ir.Value):
            return ArrayMapping()
        dims, seen = [], set()
        for dim in factors.of(v):
            names = [name(f, seen) for f in dim]
            seen.update(dim)
            if len(names) == 1:
                whole.add(names[0])
                dims.append(names[0])
            elif names:
                compound.update(names)
                dims.append(CompoundFactor(*names))
            else:
                dims.append(f"u{len(sizes)}")
                sizes[dims[-1]] = 1
        return ArrayMapping(*dims)

    operands = tuple(mapping(v) for v in graph.inputs)
    results = tuple(mapping(v) for v in graph.outputs)
    pinned = tuple(sorted(n for n in whole | compound if n.startswith("f") and int(n[1:]) in factors.pinned))
    return SdyShardingRule(operands, results, need_replication_factors=pinned,
                           **{n: sizes[n] for n in compound - whole})


def _axes_of(spec: PartitionSpec, ndim: int):
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


def _shardings(mesh, specs) -> tuple:
    return tuple(NamedSharding(mesh, PartitionSpec(*(None if not a else a[0] if len(a) == 1 else a for a in spec)))
                 for spec in specs)


requires_devices_during_lowering(primitive.stitch_p)
mlir.register_lowering(primitive.stitch_p, partitioned(primitive.fallback_rule))
mlir.register_lowering(primitive.stitch_p, partitioned(primitive.cuda_rule), platform="cuda")
