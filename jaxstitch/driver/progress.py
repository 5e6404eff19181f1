"""What a build is doing while it runs, and one INFO line when it ends.

A build longer than DELAY_S (BERT's train step: ~17 s, 101 NVRTC compiles) shows its regions planned
and NVRTC's compiles done and to go on stderr: on a terminal as one line rewritten in place, anywhere
else (a log file, a notebook) as a line every LINE_EVERY_S; a build that shows a line ends it with its
total. Shorter builds print nothing. Every build logs one INFO line on the "jaxstitch" logger: the
regions stitched, kernels, NVRTC's compiles and seconds, and the build's own seconds.

The pipeline calls `planning` around the regions it plans in turn; families.build_any wraps each
build in `building`, whose name (the function's) also names the build's dump folder (dumps.py).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import re
import sys
import threading
import time

from ..kernels import cache

log = logging.getLogger("jaxstitch")

DELAY_S = 3.0        # a build shorter than this prints nothing
TTY_EVERY_S = 0.5    # a terminal's line is rewritten this often
LINE_EVERY_S = 10.0  # elsewhere, a new line this often
_NAME_CHARS = 40     # of the function's name in a progress line

_NAME: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxstitch_build", default=None)
_LOCK = threading.Lock()       # the counters and the list of builds under way
_OUT_LOCK = threading.Lock()   # one writer of stderr's progress line at a time
_WAKE = threading.Event()      # a build ended: the reporter looks again at once


@dataclasses.dataclass(kw_only=True)
class _Build:
    """A build under way: its name, and where the counters stood when it began."""

    name: str
    start: float
    stats: cache.Stats
    known: int
    planned: int
    show: bool
    shown: bool = False

    def done(self, program) -> None:
        """Logs the INFO line for `program` (a pipeline.Program) built by this build."""
        regions = [c for _, c in program.all_regions()]
        stitched = sum(1 for c in regions if c.stitched)
        used = _since(self.stats, cache.stats())
        times = getattr(program, "times", None)  # (build_times.BuildTimes: the seconds by stage)
        log.info("built %s in %.2f s: %d of %s stitched into %s; NVRTC: %s (%.2f s of CPU time, "
                 "%.2f s of wall time); cubins: %d from the disk cache, %d from memory%s",
                 self.name, time.perf_counter() - self.start, stitched, counted(len(regions), "region"),
                 counted(stitched, "kernel"), counted(used.nvrtc_compiles, "compile"),
                 used.nvrtc_seconds, used.nvrtc_busy_seconds, used.disk_hits, used.memory_hits,
                 f"; {times.stages_text()}" if times is not None else "")


class _Counts:
    known = 0     # regions handed to `planning`
    planned = 0   # of those, planned
    builds: list[_Build] = []
    reporter: threading.Thread | None = None


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """'1 region', '3 regions' ('1 body', '2 bodies' given `plural`)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def name_of(fun) -> str:
    """A function's name as a file name may hold it: 'train_step', 'lambda', 'partial_loss'."""
    inner = getattr(fun, "func", None)  # functools.partial
    name = getattr(fun, "__name__", None) or (f"partial_{name_of(inner)}" if inner else type(fun).__name__)
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_.") or "program"


def current_name() -> str | None:
    """The name of the build under way in this thread (None outside `building`)."""
    return _NAME.get()


def planning(regions):
    """`regions`, each counted as planned once the caller asks for the next (pipeline._complete
    plans them in turn)."""
    regions = tuple(regions)
    with _LOCK:
        _Counts.known += len(regions)
    for r in regions:
        yield r
        with _LOCK:
            _Counts.planned += 1


@contextlib.contextmanager
def building(name: str, show: bool = True):
    """A build of `name`'s program: shown on stderr if it runs long (and `show`); yields the _Build,
    whose `done(program)` logs the INFO line."""
    with _LOCK:
        b = _Build(name=name, start=time.perf_counter(), stats=cache.stats(), known=_Counts.known,
                   planned=_Counts.planned, show=show)
        _Counts.builds.append(b)
        if show and _Counts.reporter is None:
            _Counts.reporter = threading.Thread(target=_report, name="jaxstitch-progress", daemon=True)
            _Counts.reporter.start()
    token = _NAME.set(name)
    try:
        yield b
    finally:
        _NAME.reset(token)
        with _LOCK:
            _Counts.builds.remove(b)
            shown = b.shown
        _WAKE.set()
        if shown:
            with _OUT_LOCK:
                _write(_line(b, final=True), final=True)


def _since(before: cache.Stats, after: cache.Stats) -> cache.Stats:
    return cache.Stats(*(a - b for a, b in zip(dataclasses.astuple(after), dataclasses.astuple(before))))


def _line(b: _Build, final: bool = False) -> str:
    with _LOCK:
        known, planned, others = _Counts.known - b.known, _Counts.planned - b.planned, len(_Counts.builds) - 1
    name = b.name if len(b.name) <= _NAME_CHARS else b.name[:_NAME_CHARS - 3] + "..."
    done = cache.stats().nvrtc_compiles - b.stats.nvrtc_compiles
    seconds = time.perf_counter() - b.start
    if final:
        return (f"jaxstitch: built {name} in {seconds:.1f} s: {counted(planned, 'region')} planned, "
                f"{counted(done, 'NVRTC compile')}")
    pending, running = cache.in_flight()
    more = f" (and {counted(others, 'other build')})" if others > 0 else ""
    planning = f"{planned} of {counted(known, 'region')} planned" if known else "tracing, partitioning"
    return (f"jaxstitch: building {name}{more}: {planning}, NVRTC {done} done, {pending} to go "
            f"({running} compiling), {seconds:.0f} s")


def _is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


_width = [0]  # the terminal line's length as last written


def _write(text: str, final: bool = False):
    """A progress line (the caller holds _OUT_LOCK): rewritten in place on a terminal, a line of its
    own elsewhere."""
    try:
        if _is_tty():
            pad = " " * max(0, _width[0] - len(text))
            sys.stderr.write("\r" + text + pad + ("\n" if final else ""))
            _width[0] = 0 if final else len(text)
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # (stderr closed: progress is never worth an error)


def _report():
    """The reporter thread: while any build with `show` is under way, shows the oldest one's line
    once it has run DELAY_S."""
    due = 0.0
    while True:
        with _LOCK:
            shown = [b for b in _Counts.builds if b.show]
            if not shown:
                _Counts.reporter = None
                return
            b = shown[0]
        now = time.perf_counter()
        if now - b.start >= DELAY_S and now >= due:
            with _OUT_LOCK:  # (the build may have ended meanwhile: then it has no line to end)
                with _LOCK:
                    alive = b in _Counts.builds
                    b.shown = b.shown or alive
                if alive:
                    _write(_line(b))
            due = now + (TTY_EVERY_S if _is_tty() else LINE_EVERY_S)
        _WAKE.wait(0.1)
        _WAKE.clear()
