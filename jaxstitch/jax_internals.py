"""The one module that reaches into `jax._src`, for what JAX has no public API for yet.

- Lowering a region under a mesh of several devices goes through `custom_partitioning`, whose
  lowering needs the device assignment; JAX computes it during lowering only for primitives listed
  in `dispatch.prim_requires_devices_during_lowering` (as jax's own cuDNN attention does).
"""
from __future__ import annotations


def requires_devices_during_lowering(primitive) -> None:
    from jax._src import dispatch

    dispatch.prim_requires_devices_during_lowering.add(primitive)
