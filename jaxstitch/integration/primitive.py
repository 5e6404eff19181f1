"""The `stitch` primitive: one region, carried as its jaxpr, lowered to our kernel on CUDA.

Built like `closed_call`: it holds the region's jaxpr, so its lowering anywhere but CUDA (or when no
kernel was planned) simply evaluates that jaxpr with XLA; the transformation rules (transforms.py)
transform the jaxpr and plan the result again in the `context` the region carries. The HLO holds
the cubin bytes and their content hash, never a process-local pointer, so JAX's persistent
compilation cache and jax.export keep working.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.extend import core as jcore
from jax.interpreters import mlir

from ..frontend import trace
from ..kernels import xla_kernel
from . import ffi, jax_internals


@dataclasses.dataclass(frozen=True)
class Launch:
    """What the launcher needs for one kernel; hashable so it can be a primitive parameter."""

    key: str
    cubin: bytes = dataclasses.field(repr=False)
    kernel: str
    grid: int
    block: int
    smem: int
    cooperative: bool
    workspace_bytes: int
    poison: bool = False
    rows: int = 0               # the kernel's row count (or tile count) ...
    rows_buffer: int = -1       # ... or read off this buffer at run time (integration/ffi.py)
    row_elems: int = 1
    rows_per_block: int = 0     # > 0: the grid follows the row count at run time
    splits: int = 1             # blocks sharing a row (the grid follows rows x splits)
    buffers: int = -1           # pointers the kernel takes (-1: all; less: no workspace)
    alternatives: tuple[ffi.Alternative, ...] = ()  # kernels for fewer rows (integration/ffi.py)
    aliases: tuple[tuple[int, int], ...] = ()  # (argument, result) sharing a buffer: written in place
    ptx: str | None = dataclasses.field(default=None, repr=False)  # set: XLA's kernel call (kernels/xla_kernel.py)


stitch_p = jcore.Primitive("jaxstitch_stitch")
stitch_p.multiple_results = True


def stitch(args, *, jaxpr, launch: Launch | None, context):
    return stitch_p.bind(*args, jaxpr=jaxpr, launch=launch, context=context)


def _impl(*args, jaxpr, launch, context):
    return jax.jit(lambda *a: stitch_p.bind(*a, jaxpr=jaxpr, launch=launch, context=context))(*args)


def _abstract_eval(*avals, jaxpr, launch, context):
    return list(jaxpr.out_avals)


def _evaluate(*args, jaxpr, launch, context):
    return trace.jaxpr_as_fun(jaxpr)(*args)


def _launch(*args, jaxpr, launch, context):
    outs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jaxpr.out_avals]
    extra = [jax.ShapeDtypeStruct((launch.workspace_bytes,), np.uint8)] if launch.workspace_bytes else []
    results = ffi.launch(list(args), out_types=outs + extra, cubin=launch.cubin, key=launch.key,
                         kernel=launch.kernel, grid=launch.grid, block=launch.block, smem=launch.smem,
                         cooperative=launch.cooperative, poison=launch.poison, rows=launch.rows,
                         rows_buffer=launch.rows_buffer, row_elems=launch.row_elems,
                         rows_per_block=launch.rows_per_block, splits=launch.splits,
                         buffers=launch.buffers, alternatives=launch.alternatives,
                         input_output_aliases=dict(launch.aliases),
                         target=ffi.TARGET if context.cfg.tuning.cmd_buffers else ffi.TARGET_PLAIN)
    return list(results)[:len(outs)]


def xla_kernel_rule(ctx, *args, jaxpr, launch, context):
    """The kernel as XLA's own kernel call: XLA passes the buffers, operands then results."""
    def layout(aval):
        return tuple(range(len(aval.shape) - 1, -1, -1))  # row-major, as the kernel indexes

    config = xla_kernel.backend_config(launch.ptx, launch.kernel, launch.grid, launch.block, launch.smem)
    call = jax_internals.custom_call(
        xla_kernel.TARGET, result_types=[mlir.aval_to_ir_type(ctx.module_context, a) for a in ctx.avals_out],
        operands=list(args), backend_config=config,
        operand_layouts=[layout(a) for a in ctx.avals_in], result_layouts=[layout(a) for a in ctx.avals_out])
    return call.results


fallback_rule = mlir.lower_fun(_evaluate, multiple_results=True)
launch_rule = mlir.lower_fun(_launch, multiple_results=True)


# (spmd/lowering.py registers these again, wrapped for programs partitioned over several devices)
def cuda_rule(ctx, *args, jaxpr, launch, context):
    rule = fallback_rule if launch is None else xla_kernel_rule if launch.ptx else launch_rule
    return rule(ctx, *args, jaxpr=jaxpr, launch=launch, context=context)


stitch_p.def_impl(_impl)
stitch_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(stitch_p, fallback_rule)
mlir.register_lowering(stitch_p, cuda_rule, platform="cuda")
