"""The Python side of jaxstitch's one generic XLA FFI launcher.

Why one handler for every kernel: a stitched region becomes a custom call to
``jaxstitch_launch`` whose attributes carry the kernel's cubin bytes, a content
hash of them (the handler's module-cache key), the ``extern "C"`` kernel name
and the launch shape. The HLO thus holds only data, never a process-local
pointer, so JAX's persistent compilation cache and ``jax.export`` keep working:
a fresh process loads the module from the bytes the first time it runs.

The handler (``kernels/launcher.cc``, built by ``setup.py`` into ``kernels/_launcher*.so``)
loads the module at XLA's initialize stage, or lazily at execute, and launches
the kernel with one pointer parameter per buffer: every argument buffer in
order, then every result buffer in order.
"""
from __future__ import annotations

import ctypes
import dataclasses
import glob
import os
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

TARGET = "jaxstitch_launch"
# The same handler registered without XLA's command-buffer trait: launched between XLA's CUDA
# graphs rather than traced into them (kernels/launcher.cc; core/config.py Tuning.cmd_buffers).
TARGET_PLAIN = "jaxstitch_launch_plain"

_lock = threading.Lock()
_result: tuple[bool, str | None] | None = None


def _find_library() -> str | None:
    kernels = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
    found = sorted(glob.glob(os.path.join(kernels, "_launcher*.so")))
    return found[0] if found else None


def _register() -> tuple[bool, str | None]:
    path = _find_library()
    if path is None:
        return False, ("the extension jaxstitch/kernels/_launcher*.so is not built: building it at install "
                       "time needs a C++17 compiler and jaxlib's headers (setup.py)")
    try:
        lib = ctypes.cdll.LoadLibrary(path)
        handlers = {TARGET: lib.JaxstitchLaunchExecute, TARGET_PLAIN: lib.JaxstitchLaunchExecutePlain}
        initialize = jax.ffi.pycapsule(lib.JaxstitchLaunchInitialize)
    except (OSError, AttributeError) as e:
        return False, f"loading {path} failed (built for another jaxlib or system?): {e}"
    notes = []
    for target, symbol in handlers.items():
        ok, note = _register_target(target, jax.ffi.pycapsule(symbol), initialize)
        if not ok:
            return False, note
        notes += [note] if note else []
    return True, "; ".join(notes) or None


def _register_target(target: str, execute, initialize) -> tuple[bool, str | None]:
    # Where the CUDA plugin is already initialized this registers at once.
    # Otherwise jax queues it for the plugin's initialization; on a CPU-only
    # machine that never comes, which is fine: the target exists only on CUDA.
    try:
        jax.ffi.register_ffi_target(
            target, {"initialize": initialize, "execute": execute}, platform="CUDA")
        return True, None
    except Exception as dict_error:  # an XLA too old for handler bundles
        try:
            jax.ffi.register_ffi_target(target, execute, platform="CUDA")
            return True, f"{target}: registered the execute stage only ({dict_error})"
        except Exception as e:
            return False, f"registering {target} failed: {e}"


def register() -> tuple[bool, str | None]:
    """Registers the launcher for platform CUDA, once per process.

    Returns ``(ok, note)``: ``(True, None)`` on success, ``(False, reason)``
    when the extension is missing or cannot be loaded or registered. Never
    raises, so callers can fall back to XLA.
    """
    global _result
    with _lock:
        if _result is None:
            _result = _register()
        return _result


@dataclasses.dataclass(frozen=True)
class Alternative:
    """Another kernel of the same region, run instead of the main one when the row count is below
    `below_rows` (a shape family's variant: e.g. rows split over blocks for few long rows). Its
    kernel has the main one's name; `buffers`: pointers it takes before the row count (-1: all)."""

    below_rows: int
    cubin: bytes = dataclasses.field(repr=False)
    key: str
    grid: int
    block: int
    smem: int
    cooperative: bool
    rows_per_block: int
    splits: int = 1
    buffers: int = -1


def launch(
    args: Sequence[Any],
    *,
    out_types: Sequence[jax.ShapeDtypeStruct],
    cubin: bytes,
    key: str,
    kernel: str,
    grid: int,
    block: int,
    smem: int,
    cooperative: bool,
    poison: bool = False,
    rows: int = 0,
    rows_buffer: int = -1,
    row_elems: int = 1,
    rows_per_block: int = 0,
    splits: int = 1,
    buffers: int = -1,
    alternatives: Sequence[Alternative] = (),
    input_output_aliases: dict[int, int] | None = None,
    target: str = TARGET,
):
    """Calls ``kernel`` from ``cubin`` on ``args``; returns the list of results.

    ``out_types`` gives the result buffers. The kernel's parameters are one
    pointer per buffer: ``args`` in order, then the results in order. With
    ``cooperative`` the grid is clamped to the blocks that fit at once (one
    wave), so such kernels must loop over their work, and the last result is
    their workspace, whose first 16 bytes the launcher zeroes for the grid
    barrier. ``poison`` fills the results with 0xFF bytes first (tests).

    After the buffers the kernel gets the row count (a ``long long``):
    ``rows``, or with ``rows_buffer`` >= 0 the element count of that buffer
    (arguments first, then results) over ``row_elems``, so that a shape family's
    kernel lowered with symbolic dimensions sizes itself at run time. With
    ``rows_per_block`` the grid is at most ``grid`` and at most one block per
    ``rows_per_block`` rows (times ``splits``: blocks sharing a row).
    ``buffers`` >= 0: the kernel takes only the first ``buffers`` pointers
    (results without the workspace an alternative needs).

    ``alternatives``, in increasing ``below_rows``: the first made for more rows
    than there are runs instead (the launcher picks by the actual row count).

    ``input_output_aliases``: argument index -> result index of buffers that are one
    (results written over arguments the kernel has read).

    ``target``: another registration of the same handler (TARGET_PLAIN). Every attribute
    is always passed: XLA's FFI reports a missing one from inside the handler,
    which once crashed the process.
    """
    return jax.ffi.ffi_call(target, list(out_types), input_output_aliases=input_output_aliases)(
        *args,
        cubin=np.frombuffer(cubin, np.uint8),
        key=key,
        kernel=kernel,
        grid=np.int64(grid),
        block=np.int64(block),
        smem=np.int64(smem),
        cooperative=np.int64(int(cooperative)),
        poison=np.int64(int(poison)),
        rows=np.int64(rows),
        rows_buffer=np.int64(rows_buffer),
        row_elems=np.int64(row_elems),
        rows_per_block=np.int64(rows_per_block),
        splits=np.int64(splits),
        buffers=np.int64(buffers),
        **_packed(alternatives),
    )


def _packed(alternatives: Sequence[Alternative]) -> dict:
    """The alternatives as the launcher's three attributes (launcher.cc: Alternatives); one 0 in
    each array when there are none."""
    alts = sorted(alternatives, key=lambda a: a.below_rows)
    if not alts:
        return dict(alt_launch=np.zeros(1, np.int64), alt_cubins=np.zeros(1, np.uint8), alt_keys="-")
    fields = [(a.below_rows, a.grid, a.block, a.smem, int(a.cooperative), a.rows_per_block, a.splits,
               a.buffers, len(a.cubin)) for a in alts]
    return dict(alt_launch=np.array(fields, np.int64).reshape(-1),
                alt_cubins=np.frombuffer(b"".join(a.cubin for a in alts), np.uint8),
                alt_keys=" ".join(a.key for a in alts))
