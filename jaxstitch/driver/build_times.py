"""Where a build's seconds go, stage by stage.

A build (families.build_any) runs under `measuring()`; the pipeline wraps its stages in `stage(name)`:
each second of the build's own thread goes to the innermost stage under way, so the stages add up
to no more than the build. NVRTC compiles in background threads beside planning (kernels/cache.py):
its stage is the time the build waited on it; the wall time it ran and its CPU time are the cache's
counts over the build. Control-flow bodies are built as programs of their own, counted whole under
`bodies` (`apart`).

XLA's compile of the rebuilt program is timed apart, by jax's own events
(integration/xla_compiles.py).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import time

from ..kernels import cache

log = logging.getLogger("jaxstitch")

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
