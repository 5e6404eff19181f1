"""An internal error leaves its region (or the program) to XLA, with one warning, never a crash.

Planning, code generation and NVRTC are ours: an exception there is a jaxstitch bug, not the
user's. The region then runs as XLA would run it, the user's program still gives jax.jit's
results, and a warning, once per distinct failure, names the region's key ops and the user's
source line and asks for a bug report with the dump. JAXSTITCH_STRICT=1 raises instead (the test
suite runs so, for bugs to fail tests).
"""
from __future__ import annotations

import logging
import traceback

from ..core import ir
from ..core import ops as opdefs

log = logging.getLogger("jaxstitch")
_SAID: set[tuple] = set()


def key_ops(ops) -> str:
    """The region's ops by importance: reductions and scans first, then the rest, counted."""
    counts: dict[str, int] = {}
    for op in ops:
        counts[op.prim] = counts.get(op.prim, 0) + 1
    first = [p for p in counts if p in opdefs.REDUCTIONS or p in opdefs.SCANS]
    rest = sorted((p for p in counts if p not in first), key=lambda p: -counts[p])
    return ", ".join(f"{p}" + (f" x{counts[p]}" if counts[p] > 1 else "") for p in first + rest)


def region_failed(stage: str, ops: tuple[ir.Op, ...], where: str, error: BaseException) -> str:
    """The reason a region stays XLA's after `error` in `stage` (planning, codegen, NVRTC), warned
    about once per failure; `where` is the user's source line of its first op."""
    reason = f"internal error in {stage}: {type(error).__name__}: {error}"
    said = (stage, type(error).__name__, str(error)[:200], key_ops(ops))
    if said not in _SAID:
        _SAID.add(said)
        frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
        at = f" (raised at {frame.filename.rsplit('/', 2)[-1]}:{frame.lineno})" if frame else ""
        log.warning("jaxstitch: a region (%s%s) is left to XLA after an internal error in %s: %s: %s%s. "
                    "Results are unaffected. Please file a bug report with the dump that "
                    "JAXSTITCH_DUMP_DIR=<folder> writes; JAXSTITCH_STRICT=1 raises instead.",
                    key_ops(ops), f", from {where}" if where else "", stage, type(error).__name__,
                    str(error).splitlines()[0] if str(error) else "", at)
    return reason


def program_failed(stage: str, name: str, error: BaseException) -> None:
    """Warns, once per failure, that the whole program `name` runs as jax.jit after `error`."""
    said = ("program", stage, type(error).__name__, str(error)[:200])
    if said in _SAID:
        return
    _SAID.add(said)
    log.warning("jaxstitch: %s runs as jax.jit after an internal error in %s: %s: %s. Please file a bug "
                "report with the dump that JAXSTITCH_DUMP_DIR=<folder> writes; JAXSTITCH_STRICT=1 "
                "raises instead.", name, stage, type(error).__name__, str(error).splitlines()[0] if str(error) else "")
