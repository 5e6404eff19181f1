"""The one module that reaches into `jax._src`, for what JAX has no public API for yet.

- Lowering a region under a mesh of several devices goes through `custom_partitioning`, whose
  lowering needs the device assignment; JAX computes it during lowering only for primitives listed
  in `dispatch.prim_requires_devices_during_lowering` (as jax's own cuDNN attention does).
- A custom call with a raw backend config string (XLA's own kernel call, kernels/xla_kernel.py):
  `jax.ffi` builds only calls to FFI handlers, whose backend config is a dictionary.
- Whether a call is eager (no trace active): the program guard starts compiling jax.jit's program
  beside the stitched one only for a call it will measure (guard.py).
- Hiding our frames from the tracebacks JAX filters (`traceback_util.register_exclusion`), as JAX
  hides its own: an error in the user's function then shows the user's frames only.
"""
from __future__ import annotations


def requires_devices_during_lowering(primitive) -> None:
    from jax._src import dispatch

    dispatch.prim_requires_devices_during_lowering.add(primitive)


def custom_call(target: str, *, result_types, operands, backend_config: str, operand_layouts, result_layouts):
    """A StableHLO custom call to `target` with `backend_config` as its raw string."""
    from jax._src.interpreters import mlir

    return mlir.custom_call(target, result_types=result_types, operands=operands, backend_config=backend_config,
                            operand_layouts=operand_layouts, result_layouts=result_layouts)


def hide_frames(path: str | None = None) -> None:
    """Exclude the files under `path` (the jaxstitch package by default) from the tracebacks JAX
    filters (JAX_TRACEBACK_FILTERING) and from the user frames JAX records as equations' sources."""
    import os

    from jax._src import traceback_util

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # jaxstitch/, above integration/
    traceback_util.register_exclusion(path or package)


def eager() -> bool:
    """Whether no JAX trace is active here (a call with values, not under jit or a transformation)."""
    from jax._src import core

    return core.trace_state_clean()
