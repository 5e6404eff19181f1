"""Where a build's seconds go, stage by stage, and XLA's compile of the program it rebuilt.

A build (families.build_any) runs under `measuring()`; the pipeline wraps its stages in `stage(name)`:
each second of the build's own thread goes to the innermost stage under way, so the stages add up
to no more than the build. NVRTC compiles in background threads beside planning (kernels/cache.py):
its stage is the time the build waited on it; the wall time it ran and its CPU time are the cache's
counts over the build. Control-flow bodies are built as programs of their own, counted whole under
`bodies` (`apart`).

XLA's compile of the program jaxstitch.jit rebuilt follows the build in the same thread, once jax.jit
has traced it: `expect_xla_compile` waits for jax's backend-compile event there (jax.monitoring,
'/jax/core/compile/backend_compile_duration' in jax 0.10 and 0.11), logs one INFO line and keeps a
record (`compiles()`). A shape family's program (jax.export) compiles at each new shape where the
user calls the exported program: `xla_compiling()` counts those compiles in a block.
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import logging
import threading
import time

from .kernels import cache

log = logging.getLogger("jaxstitch")

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
STAGES = ("trace", "partition", "plan", "nvrtc", "bodies")
_LABELS = {"nvrtc": "NVRTC wait"}  # (the time the build waited on it; it runs in the background)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildTimes:
    """A build's seconds by stage: trace (at sample sizes too), partition (with recompute), plan
    (planning and codegen), nvrtc (waited on it), bodies (control-flow bodies, whole); beside them
    NVRTC's wall time running and CPU time, which overlap planning."""

    total: float
    trace: float = 0.0
    partition: float = 0.0
    plan: float = 0.0
    nvrtc: float = 0.0
    bodies: float = 0.0
    nvrtc_busy: float = 0.0   # wall time during which at least one NVRTC compile ran
    nvrtc_cpu: float = 0.0    # NVRTC's time summed over its compiles (side by side)
    nvrtc_compiles: int = 0

    @property
    def other(self) -> float:
        """What no stage holds: the build's setup, shape families' matching, dumps."""
        return max(0.0, self.total - sum(getattr(self, s) for s in STAGES))

    def stages_text(self, digits: int = 2) -> str:
        """'trace 1.20 s, partition 3.40 s, plan 0.90 s, NVRTC wait 2.10 s' (bodies and other where
        they took time)."""
        parts = [(_LABELS.get(s, s), getattr(self, s)) for s in STAGES]
        parts.append(("other", self.other))
        shown = [(k, v) for k, v in parts if v >= 0.005 or k in ("trace", "partition", "plan", "NVRTC wait")]
        return ", ".join(f"{k} {v:.{digits}f} s" for k, v in shown)


class _Clock:
    """One build's seconds by stage, each to the innermost stage under way."""

    def __init__(self):
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.stack: list[list] = []  # [stage, when it last resumed]

    def enter(self, name: str):
        now = time.perf_counter()
        if self.stack:
            self._add(self.stack[-1], now)
        self.stack.append([name, now])

    def leave(self):
        now = time.perf_counter()
        self._add(self.stack.pop(), now)
        if self.stack:
            self.stack[-1][1] = now

    def _add(self, entry: list, now: float):
        self.seconds[entry[0]] += now - entry[1]


_CLOCK: contextvars.ContextVar[_Clock | None] = contextvars.ContextVar("jaxstitch_build_clock", default=None)


@contextlib.contextmanager
def stage(name: str):
    """The block's time counted to `name` in the build under way in this thread (if any)."""
    clock = _CLOCK.get()
    if clock is None:
        yield
        return
    clock.enter(name)
    try:
        yield
    finally:
        clock.leave()


@contextlib.contextmanager
def apart(name: str):
    """The block's time counted whole to `name`: builds inside it (control-flow bodies) keep their
    stages out of this build's."""
    with stage(name):
        token = _CLOCK.set(None)
        try:
            yield
        finally:
            _CLOCK.reset(token)


def unmeasured(fn, *args):
    """fn(*args) outside any build's clock: work in another thread, which the build waits for."""
    token = _CLOCK.set(None)
    try:
        return fn(*args)
    finally:
        _CLOCK.reset(token)


class Measuring:
    """A build being measured (`measuring`); `times()` once it ends."""

    def __init__(self):
        self.clock = _Clock()
        self.start = time.perf_counter()
        self.before = cache.stats()

    def times(self) -> BuildTimes:
        used = cache.stats()
        return BuildTimes(total=time.perf_counter() - self.start, **self.clock.seconds,
                          nvrtc_busy=used.nvrtc_busy_seconds - self.before.nvrtc_busy_seconds,
                          nvrtc_cpu=used.nvrtc_seconds - self.before.nvrtc_seconds,
                          nvrtc_compiles=used.nvrtc_compiles - self.before.nvrtc_compiles)


@contextlib.contextmanager
def measuring():
    """A build's clock for the pipeline's stages in this thread (a nested build gets its own)."""
    m = Measuring()
    token = _CLOCK.set(m.clock)
    try:
        yield m
    finally:
        _CLOCK.reset(token)


# --- XLA's compile of the rebuilt program ---------------------------------------------------------

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
            import jax.monitoring  # (jax's public listener API)

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
