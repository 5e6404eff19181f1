"""The program guard: a stitched program that measures slower than `jax.jit`'s is replaced by it.

The planner decides from a model of the GPU and of XLA, and a model can be wrong (a ViT-like step
measured 0.80x in one process and 1.21x in another). So on the first call at each new set of
argument shapes, the call that traced and compiled the stitched program, the guard also compiles
`jax.jit`'s program of the same function with the same options, runs the two in turns on that
call's inputs, and keeps the stitched one only where its median time a call is below `jax.jit`'s.

What it costs, once per new set of shapes: `jax.jit`'s own XLA compile, in a thread beside our build
and XLA's compile of the stitched program (the call's wait grows by what it outlasts them), and
at most `MEASURE_SECONDS` of timed calls; no call after it pays anything
where every set of shapes kept the stitched program, and one look-up of the shapes where some did
not. A program with no stitched kernel is not measured (it is `jax.jit`'s already).

It does not measure, and keeps the stitched program, where measuring could change what the user
sees or cannot be done alike: calls under a JAX transformation or another `jit` (no values), a
program with side effects (`jax.debug.print`, callbacks: they would run again), and arrays over
several devices or explicit shardings. Donated arguments are copied for each timed call (zeros in
place of one already deleted), so the user's buffers are never read after the call gave them up.

A decision is remembered on disk beside the kernels (`<cache_dir>/guard/`), keyed by the program
(its equations, shapes and kernels), the jit options, the GPU and the versions of jax, jaxlib and
jaxstitch: a later process, or another jitted function of the same program, takes it at the trace
without compiling or timing anything (where jax.jit's won, the trace is then `jax.jit`'s program).

On by default where the kernels run on a GPU; `JAXSTITCH_GUARD=0` or `jaxstitch.jit(..., guard=False)`
turns it off, and `guard=True` turns it on elsewhere too (a CPU measures XLA against itself).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import gc
import hashlib
import json
import logging
import os
import re
import statistics
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import jaxlib

from ..kernels import cache
from . import jax_internals

log = logging.getLogger("jaxstitch")

MEASURE_SECONDS = 2.0   # timed calls per new set of shapes stop after this long...
MIN_CALLS = 5           # ...once each program ran this many times
MAX_CALLS = 25          # each program's timed calls at most
TIE = 0.02              # medians closer than this, a tie (see _decision)

STITCHED = "stitched"
XLA = "jax.jit"
DECISIONS_DIR = "guard"  # under the kernel cache's directory


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decision:
    """What the guard chose for one set of argument shapes, and from what."""

    shapes: str                  # the arguments' shapes and dtypes, as jax writes them
    choice: str                  # STITCHED or XLA
    stitched_ms: float | None    # median ms a call (None: not measured)
    xla_ms: float | None
    calls: int = 0               # timed calls of each program
    why: str = ""                # why it was not measured, or what the medians decided

    def __str__(self) -> str:
        if self.stitched_ms is None:
            return f"{self.shapes}: {self.choice} ({self.why})"
        return (f"{self.shapes}: {self.choice} (stitched {self.stitched_ms:.3f} ms, jax.jit "
                f"{self.xla_ms:.3f} ms a call, median of {self.calls})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Traced:
    """What the stitched program's trace tells the guard: its kernels, whether it has effects, its
    key on disk and the decision remembered there."""

    stitched_kernels: int
    effectful: bool
    key: str | None = None
    remembered: Decision | None = None


class Guarded:
    """`jaxstitch.jit`'s function with the guard: called like the `jax.jit` object it wraps (and its
    `lower`, `trace`, `eval_shape` are that object's: the stitched program, unguarded)."""

    def __init__(self, fun: Callable, stitched: Any, xla: Any, donated_leaves: Callable, measurable: bool,
                 decisions_dir: str | None = None, options: str = ""):
        functools.update_wrapper(self, fun)
        self._dir = decisions_dir          # where decisions are remembered (None: nowhere)
        self._options = options            # the jit options, part of a decision's key
        self._stitched = stitched          # jax.jit of the stitched program
        self._xla = xla                    # jax.jit of `fun`, the same options
        self._donated_leaves = donated_leaves  # (args, kwargs) -> flat positions of donated leaves
        self._measurable = measurable      # False: explicit shardings (see the module's docstring)
        self._traced: list[Traced] = []    # the stitched program's traces since the last call began
        self._call = None                  # the call under way's (args, kwargs), where it has values
        self._xla_compile: concurrent.futures.Future | None = None  # jax.jit's, started at the trace
        self._xla_keys: set = set()        # the sets of shapes that run jax.jit's program
        self.guard_decisions: list[Decision] = []

    def on_trace(self, program) -> str:
        """Called by the stitched program's trace (a new set of shapes, or a transformation's) with
        the program built (None: the build failed, the trace is `fun`'s): which program to trace,
        STITCHED or, where a remembered decision says so, XLA. Where the call will be measured,
        jax.jit's program starts compiling now, beside the stitched one's."""
        if program is None:
            self._traced.append(Traced(stitched_kernels=0, effectful=False))
            return STITCHED
        traced = Traced(stitched_kernels=sum(c.stitched for _, c in program.all_regions()),
                        effectful=any(e.effectful for e in program.traced.eqns))
        if traced.stitched_kernels and not traced.effectful and self._dir:
            key = program_key(program, self._options)
            traced = dataclasses.replace(traced, key=key, remembered=_recall(self._dir, key))
        self._traced.append(traced)
        if traced.key and not traced.remembered and self._call is not None and self._measurable:
            self._xla_compile = _compile_beside(self._xla, *self._call)
        return traced.remembered.choice if traced.remembered else STITCHED

    def __call__(self, *args, **kwargs):
        if self._xla_keys and _key(args, kwargs) in self._xla_keys:
            return self._xla(*args, **kwargs)
        self._traced.clear()  # (left by `lower` or `eval_shape`)
        self._call = (args, kwargs) if jax_internals.eager() else None
        try:
            outs = self._stitched(*args, **kwargs)
        finally:
            self._call = None
        if self._traced:
            self._settle(self._traced[-1], args, kwargs)
            self._traced.clear()
        return outs

    def __getattr__(self, name):
        return getattr(self._stitched, name)

    def __get__(self, obj, objtype=None):  # a method, as jax.jit's functions are
        return self if obj is None else functools.partial(self, obj)

    def _settle(self, traced: Traced, args, kwargs) -> None:
        """Measure and decide for the shapes this call traced, where that can be done."""
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        shapes = _shapes(leaves)
        why = _not_measured(traced, leaves, self._measurable)
        if traced.remembered is not None and why != _UNDER_A_TRACE:
            self._decided(dataclasses.replace(traced.remembered, why="remembered on disk"))
            return
        if why:
            if why != _UNDER_A_TRACE:
                self._decided(Decision(shapes=shapes, choice=STITCHED, stitched_ms=None, xla_ms=None, why=why))
            return
        try:
            if self._xla_compile is not None:  # (a failure here leaves the compile to the first call)
                concurrent.futures.wait([self._xla_compile])
                self._xla_compile = None
            decision = _measure(self._stitched, self._xla, args, kwargs, self._donated_leaves(args, kwargs), shapes)
        except Exception as e:  # noqa: BLE001 - a failed measurement keeps what ran
            decision = Decision(shapes=shapes, choice=STITCHED, stitched_ms=None, xla_ms=None,
                                why=f"measuring failed: {type(e).__name__}: {e}")
        if decision.choice == XLA:
            self._xla_keys.add(_key(args, kwargs))
        if decision.stitched_ms is not None and traced.key and self._dir:
            _remember(self._dir, traced.key, decision)
        self._decided(decision)

    def _decided(self, decision: Decision) -> None:
        self.guard_decisions.append(decision)
        log.info("guard: %s at %s", getattr(self, "__qualname__", "?"), decision)


_UNDER_A_TRACE = "called under a JAX transformation or another jit"


def _compile_beside(xla, args, kwargs) -> concurrent.futures.Future | None:
    """jax.jit's program for the call's arguments, lowered here and compiled in a thread: XLA
    compiles with the interpreter unlocked, beside our build and the stitched program's compile.
    The jitted function's own calls on arguments placed alike then find the executable (jax keeps
    one lowering and compile for a function, its argument types and shardings: lowered from the
    call's own arrays, committed ones included). None where lowering it here fails."""
    try:
        lowered = xla.lower(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the measurement compiles it at its first call instead
        log.debug("guard: lowering jax.jit's program beside the build failed: %s", e)
        return None
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxstitch-guard")
    future = pool.submit(lowered.compile)
    pool.shutdown(wait=False)
    return future


def _not_measured(traced: Traced, leaves: list, measurable: bool) -> str:
    """Why the guard keeps the stitched program unmeasured ("" where it measures)."""
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return _UNDER_A_TRACE
    if traced.stitched_kernels == 0:
        return "no stitched kernel: the program is jax.jit's"
    if traced.effectful:
        return "the program has side effects, which timed calls would repeat"
    if not measurable:
        return "explicit shardings"
    if any(len(x.sharding.device_set) > 1 for x in leaves if isinstance(x, jax.Array)):
        return "arrays over several devices"
    return ""


def _key(args, kwargs):
    """The set of shapes a call is at: its tree, each array's shape, dtype and weak type, and other
    leaves by value (static arguments; a Python scalar passed as an array keys by its value too)."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    return tree, tuple((x.shape, x.dtype, getattr(x, "weak_type", False)) if hasattr(x, "dtype")
                       and hasattr(x, "shape") else _hashable(x) for x in leaves)


def _hashable(x):
    try:
        hash(x)
        return x
    except TypeError:
        return ("unhashable", id(x))


def _shapes(leaves: list) -> str:
    arrays = [x for x in leaves if hasattr(x, "dtype") and hasattr(x, "shape")]
    text = ", ".join(f"{getattr(x.dtype, 'name', x.dtype)}{list(x.shape)}" for x in arrays[:6])
    return f"({text}{', ...' if len(arrays) > 6 else ''}; {len(arrays)} arrays)"


def _measure(stitched, xla, args, kwargs, donated: frozenset[int], shapes: str) -> Decision:
    """Both programs on this call's inputs, in turns (the order swapped each round, so neither
    always runs after the other), each call waited for, with Python's garbage collector paused as
    `timeit` pauses it: one collection over a large model's arrays takes longer than a step."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    fresh_buffers = _fresh_buffers(leaves, donated)

    def once(which: str) -> float:
        buffers = fresh_buffers()
        jax.block_until_ready(list(buffers.values()))
        a, k = jax.tree_util.tree_unflatten(tree, [buffers.get(i, x) for i, x in enumerate(leaves)])
        return _timed_call(stitched if which == STITCHED else xla, a, k, which)

    collecting = gc.isenabled()
    gc.disable()
    try:
        once(STITCHED), once(XLA)  # (jax.jit's program compiles here; each runs warm after)
        times = {STITCHED: [], XLA: []}
        start = time.perf_counter()
        while len(times[XLA]) < MAX_CALLS and (len(times[XLA]) < MIN_CALLS
                                               or time.perf_counter() - start < MEASURE_SECONDS):
            for which in (STITCHED, XLA)[::1 if len(times[XLA]) % 2 else -1]:
                times[which].append(once(which))
    finally:
        if collecting:
            gc.enable()
    return _decision(times[STITCHED], times[XLA], shapes)


def _decision(ours: list[float], theirs: list[float], shapes: str) -> Decision:
    """jax.jit's program where it is faster beyond the noise: its median lower by more than TIE and
    its fastest call faster too. Closer than that, the two are a tie, and a tie keeps the stitched
    program (not measurably slower; where a loop is bound by the host's dispatch, as a large
    model's step called with many arguments can be, both read the same and the GPU time saved
    shows only once the GPU is the bound)."""
    median_ours, median_theirs = statistics.median(ours), statistics.median(theirs)
    faster = median_theirs < median_ours * (1 - TIE) and min(theirs) < min(ours)
    why = ""
    if not faster and median_theirs < median_ours:
        why = f"within the noise of jax.jit's ({TIE:.0%} of the median, or the fastest calls): a tie"
    return Decision(shapes=shapes, choice=XLA if faster else STITCHED, stitched_ms=median_ours,
                    xla_ms=median_theirs, calls=len(theirs), why=why)


def _timed_call(fn, args, kwargs, which: str) -> float:
    """ms from the call of `fn` (the `which` program) to its results on the device."""
    t = time.perf_counter()
    jax.block_until_ready(fn(*args, **kwargs))
    return (time.perf_counter() - t) * 1e3


def _fresh_buffers(leaves: list, donated: frozenset[int]) -> Callable[[], dict[int, jax.Array]]:
    """Buffers of their own for one timed call, for the arguments the programs take donated: a
    copy of each still live, zeros in place of each already deleted (the call measured gave them
    up), made in one dispatch per kind (one per array would add a host dispatch each: 658 for BERT's
    step). Each is committed to its device where the user's was and uncommitted where it was not:
    jit compiles again for arguments placed otherwise (twice for BERT's step, 43 s on an H200)."""
    arrays = {k: x for k, x in enumerate(leaves) if isinstance(x, jax.Array) and (k in donated or x.is_deleted())}
    makers = [_maker(arrays, committed) for committed in (True, False)]
    return lambda: {k: x for make in makers for k, x in make().items()}


def _maker(arrays: dict[int, jax.Array], committed: bool) -> Callable[[], dict[int, jax.Array]]:
    """One jitted function refreshing those of `arrays` committed (or not) to a device."""
    chosen = {k: x for k, x in arrays.items() if bool(getattr(x, "committed", True)) == committed}
    live = [k for k, x in chosen.items() if not x.is_deleted()]
    dead = [k for k, x in chosen.items() if x.is_deleted()]
    if not chosen:
        return dict
    zeros = [(chosen[k].shape, chosen[k].dtype) for k in dead]
    shardings = [chosen[k].sharding for k in live + dead] if committed else None
    make = jax.jit(lambda xs: [jnp.copy(x) for x in xs] + [jnp.zeros(s, d) for s, d in zeros],
                   out_shardings=shardings)
    return lambda: dict(zip(live + dead, make([chosen[k] for k in live])))


def program_key(program, options: str) -> str:
    """A stitched program's key among remembered decisions: its equations (primitive, parameters,
    shapes and dtypes), its kernels' cache keys, the jit options, the GPU, and the versions. Two
    programs that share a key compute the same function, so a collision could only cost speed."""
    h = hashlib.sha256()
    device = jax.devices()[0]
    for part in (jax.__version__, jaxlib.__version__, cache.VERSION, program.target.name,
                 device.platform, device.device_kind, options):
        h.update(f"{part}\n".encode())
    for e in program.traced.eqns:
        shapes = [f"{getattr(a, 'dtype', '')}{getattr(a, 'shape', a)}" for a in (*e.inputs, *e.outputs)]
        params = sorted((k, _ADDRESS.sub("", repr(v))) for k, v in e.params.items())
        h.update(f"{e.primitive} {shapes} {params}\n".encode())
    for _, c in program.all_regions():
        h.update(f"{c.key if c.stitched else '-'}\n".encode())
    return h.hexdigest()


_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def _path(directory: str, key: str) -> str:
    return os.path.join(directory, f"decision-{key}.json")


def _recall(directory: str, key: str) -> Decision | None:
    """The decision remembered under `key`, or None (none, or one that does not read back)."""
    try:
        with open(_path(directory, key)) as f:
            fields = json.load(f)
        return Decision(**{k: fields[k] for k in ("shapes", "choice", "stitched_ms", "xla_ms", "calls")})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remember(directory: str, key: str, decision: Decision) -> None:
    """Write `decision` under `key` (a temporary file renamed into place); a failure is logged."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(dataclasses.asdict(decision), f)
        os.replace(tmp, _path(directory, key))
    except OSError as e:
        log.warning("guard: could not remember a decision in %s: %s", directory, e)
