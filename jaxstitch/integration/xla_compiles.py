"""XLA's compile of the program jaxstitch.jit rebuilt, timed by jax's own events.

It follows the build in the same thread, once jax.jit has traced the program: `expect_xla_compile`
waits for jax's backend-compile event there (jax.monitoring,
'/jax/core/compile/backend_compile_duration' in jax 0.10 and 0.11), logs one INFO line and keeps a
record (`compiles()`). A shape family's program (jax.export) compiles at each new shape where the
user calls the exported program: `xla_compiling()` counts those compiles in a block.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading

import jax.monitoring  # (jax's public listener API)

from ..driver.build_times import BuildTimes

log = logging.getLogger("jaxstitch")

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaCompile:
    """XLA's compile of a program jaxstitch.jit rebuilt, beside jaxstitch's build of it."""

    name: str          # the user's function
    module: str        # as jax names the compiled module, e.g. 'jit(train_step)'
    seconds: float     # XLA's backend compile (or its persistent cache's retrieval)
    build: BuildTimes | None


_RECENT = 64  # compiles() keeps this many
_compiles: collections.deque = collections.deque(maxlen=_RECENT)
_local = threading.local()  # .expected: (name, jit's function name, BuildTimes); .watchers: lists
_registered = [False]
_register_lock = threading.Lock()


def compiles() -> tuple[XlaCompile, ...]:
    """The latest XLA compiles of programs jaxstitch.jit rebuilt in this process, oldest first."""
    return tuple(_compiles)


def expect_xla_compile(name: str, jitted: str, times: BuildTimes | None):
    """The next backend compile in this thread is XLA's of the program `name`'s build just rebuilt,
    if jax names its module after `jitted` (the function jax.jit traced); any other compile (an
    enclosing jit's, or none: jax.export lowers only) leaves the expectation unmet."""
    _register()
    _local.expected = (name, jitted, times)


@contextlib.contextmanager
def xla_compiling():
    """Counts XLA's backend compiles in this thread during the block: a shape family's cost at a new
    shape (`jax.jit(exported.call)` at that shape; jaxstitch builds nothing then). Yields a list of
    (module, seconds)."""
    _register()
    seen: list[tuple[str, float]] = []
    watchers = _local.__dict__.setdefault("watchers", [])
    watchers.append(seen)
    try:
        yield seen
    finally:
        watchers.remove(seen)


def _register():
    with _register_lock:
        if not _registered[0]:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _registered[0] = True


def _on_event(event: str, seconds: float, **kwargs):
    if event != BACKEND_COMPILE_EVENT:
        return
    module = str(kwargs.get("fun_name", ""))
    for seen in getattr(_local, "watchers", ()):
        seen.append((module, seconds))
    expected = getattr(_local, "expected", None)
    if expected is None:
        return
    _local.expected = None
    name, jitted, times = expected
    if module not in (f"jit({jitted})", f"jit_{jitted}", jitted):
        return
    _compiles.append(XlaCompile(name=name, module=module, seconds=seconds, build=times))
    ours = f" (our build {times.total:.2f} s: {times.stages_text()})" if times is not None else ""
    log.info("jaxstitch: %s compiled by XLA in %.2f s%s", name, seconds, ours)
