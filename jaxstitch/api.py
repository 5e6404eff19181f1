"""`jaxstitch.jit` and `jaxstitch.explain`: the two things users call."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
import os
import time
from typing import Any, Callable

import jax

from .core import config, targets
from .driver import fallback, progress
from .driver import report as report_mod
from .frontend import trace as trace_mod
from .integration import devices, families, ffi, xla_compiles
from .integration import guard as guard_mod
from .integration.stitcher import Context, make_runner
from .kernels import cache, xla_kernel


def _check_fun(fun, who: str):
    if not callable(fun):
        raise TypeError(f"{who}: `fun` must be callable, got {type(fun).__name__}")


def _resolve_target(target, who: str):
    if target is None:
        return None
    try:
        return targets.get_target(target)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{who}: argument `target`: {e}") from None


def _split_dynamic(args, kwargs):
    """Flat leaves of (args, kwargs): arrays/tracers are dynamic, anything else is baked in."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    dyn, static = [], {}
    for i, x in enumerate(leaves):
        if _is_dynamic(x):
            dyn.append(x)
        else:
            static[i] = x
    return dyn, static, tree


def _is_dynamic(x) -> bool:
    return isinstance(x, (jax.Array, jax.core.Tracer, jax.ShapeDtypeStruct)) or hasattr(x, "__jax_array__") \
        or (hasattr(x, "shape") and hasattr(x, "dtype"))


def jit(fun: Callable | None = None, *, in_shardings=None, out_shardings=None, static_argnums=None,
        static_argnames=None, donate_argnums=None, donate_argnames=None, keep_unused: bool = False,
        device=None, backend=None, inline=False, compiler_options=None, target=None, guard=None,
        tuning=None):
    """Like `jax.jit`, with the memory-bound regions of `fun` stitched into our own CUDA kernels.

    On a machine without a CUDA GPU (and no `target`), this is exactly `jax.jit(fun, ...)`.
    `target` ("h100", "h200", "a100", or an alias: see `targets.get_target`) plans for that GPU even
    elsewhere: handy to exercise the whole pipeline on a CPU, where the stitched regions then run
    through XLA. Every other parameter is `jax.jit`'s, with its meaning and value forms, and reaches
    the `jax.jit` of the stitched program: `static_argnums`/`static_argnames` and
    `donate_argnums`/`donate_argnames` (names and positions resolved through `fun`'s signature, so
    an argument passed by keyword is static or donated too; a donated buffer a kernel reads may be
    written over in place), `keep_unused`, `device`, `backend`, `inline`, `in_shardings` and
    `out_shardings` (over several devices, each runs kernels planned for its shards: integration/spmd/), and
    `compiler_options` (XLA debug options for this program, e.g.
    `{"xla_gpu_enable_command_buffer": ""}` to launch its kernels without CUDA graphs).

    `guard` (guard.py): at each new set of argument shapes, time the stitched program against
    `jax.jit`'s on that call's inputs and keep the faster. None (the default): on where the kernels
    run on a GPU, unless JAXSTITCH_GUARD=0; False: off; True: on anywhere. The function returned
    then lists what it chose in `.guard_decisions`.

    `tuning`: planner overrides for this function, as a `JAXSTITCH_TUNE` string ("max_tpr=128,elems=16")
    or a `jaxstitch.core.config.Tuning`; None: JAXSTITCH_TUNE's (every knob: docs/usage.md).
    """
    options = dict(in_shardings=in_shardings, out_shardings=out_shardings, static_argnums=static_argnums,
                   static_argnames=static_argnames, donate_argnums=donate_argnums,
                   donate_argnames=donate_argnames, keep_unused=keep_unused, device=device, backend=backend,
                   inline=inline, compiler_options=compiler_options)
    if fun is None:
        return functools.partial(jit, **options, target=target, guard=guard, tuning=tuning)
    _check_fun(fun, "jaxstitch.jit")
    tgt = _resolve_target(target, "jaxstitch.jit")
    donate = _argnums_and_names(fun, donate_argnums, donate_argnames, "donate", "jaxstitch.jit")
    jit_kwargs = {k: v for k, v in options.items() if v is not None or k not in _UNSET_IF_NONE}
    cfg = _with_tuning(config.load(), tuning, "jaxstitch.jit")
    if cfg.disabled:
        return jax.jit(fun, **jit_kwargs)
    from .integration import availability  # (what is missing here, said once a process with its fix)
    tgt = availability.usable_target(tgt)
    if tgt is None:
        return jax.jit(fun, **jit_kwargs)

    guarded = []  # the Guarded wrapper, once made: the trace tells it what it built

    @functools.wraps(fun)
    def stitched(*args, **kwargs):
        dyn, static, tree = _split_dynamic(args, kwargs)
        try:
            program = families.build_any(fun, dyn, tree, tgt, cfg, static)
            if any(g.on_trace(program) == guard_mod.XLA for g in guarded):  # (decided before)
                return fun(*args, **kwargs)
            donated = _donated_positions(args, kwargs, *donate)
            outs = make_runner(program, Context(tgt, cfg), donated)(*dyn)
        except Exception as e:  # noqa: BLE001 - jaxstitch's own failure must not break the user's program
            if cfg.strict or trace_mod.users_error(e):
                raise
            fallback.program_failed("planning", getattr(fun, "__qualname__", repr(fun)), e)
            for g in guarded:
                g.on_trace(None)
            return fun(*args, **kwargs)
        if not families.is_symbolic(dyn):  # (jax.export lowers a family; XLA compiles it per shape later)
            xla_compiles.expect_xla_compile(progress.name_of(fun), stitched.__name__, program.times)
        return jax.tree_util.tree_unflatten(program.traced.out_tree, outs)

    if not _guard_on(guard, cfg):
        return jax.jit(stitched, **jit_kwargs)
    guarded.append(guard_mod.Guarded(
        fun, jax.jit(stitched, **jit_kwargs), jax.jit(fun, **jit_kwargs),
        donated_leaves=lambda args, kwargs: _donated_leaves(args, kwargs, *donate),
        measurable=in_shardings is None and out_shardings is None,
        decisions_dir=os.path.join(cfg.cache_dir, guard_mod.DECISIONS_DIR), options=repr(sorted(jit_kwargs.items()))))
    return guarded[0]


def _with_tuning(cfg: config.Config, tuning, who: str) -> config.Config:
    """`cfg` with the planner overrides `tuning` (a JAXSTITCH_TUNE string or a Tuning) in place of
    JAXSTITCH_TUNE's; a bad value is an error naming the argument."""
    if tuning is None:
        return cfg
    if not isinstance(tuning, (str, config.Tuning)):
        raise TypeError(f"{who}: argument `tuning` must be a string like 'max_tpr=128' or a Tuning, "
                        f"got {type(tuning).__name__}")
    try:
        tuning = config.Tuning.parse(tuning) if isinstance(tuning, str) else tuning.checked()
    except ValueError as e:
        raise ValueError(f"{who}: argument `tuning`: {e}") from None
    return dataclasses.replace(cfg, tuning=tuning)


def _guard_on(guard, cfg: config.Config) -> bool:
    """Whether jit's `guard` argument, else JAXSTITCH_GUARD, else a GPU running the kernels turns it on."""
    if guard is not None:
        return bool(guard)
    if cfg.guard is not None:
        return cfg.guard
    return devices.detect() is not None


# jax.jit's parameters whose default is a sentinel, or whose None it warns about: passed only if given.
_UNSET_IF_NONE = frozenset({"in_shardings", "out_shardings", "device", "backend", "compiler_options"})


def _index_tuple(val, name: str, who: str) -> tuple[int, ...]:
    """`val` (an int or a sequence of ints, as jax.jit takes) as a tuple of ints."""
    try:
        return (operator.index(val),)
    except TypeError:
        pass
    try:
        return tuple(operator.index(v) for v in val)
    except TypeError:
        raise TypeError(f"{who}: argument `{name}` must be an int or a sequence of ints, got {val!r}") from None


def _str_tuple(val, name: str, who: str) -> tuple[str, ...]:
    """`val` (a str or an iterable of str, as jax.jit takes) as a tuple of str."""
    items = (val,) if isinstance(val, str) else tuple(val) if hasattr(val, "__iter__") else None
    if items is None or not all(isinstance(v, str) for v in items):
        raise TypeError(f"{who}: argument `{name}` must be a str or a sequence of str, got {val!r}")
    return items


def _argnums_and_names(fun, argnums, argnames, kind: str, who: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(positions, names) of the `kind` ("static" or "donate") arguments, each completed from the other
    through `fun`'s signature when only one is given (jax.jit's rule: a parameter that may be passed
    either way is `kind` both ways), so such an argument passed by keyword is `kind` too."""
    nums = None if argnums is None else _index_tuple(argnums, f"{kind}_argnums", who)
    names = None if argnames is None else _str_tuple(argnames, f"{kind}_argnames", who)
    if nums is not None and names is not None:
        return nums, names
    if nums is None and names is None:
        return (), ()
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):  # (no signature: each as given; jax.jit refuses donated names)
        if kind == "donate" and names is not None:
            raise ValueError(f"{who}: argument `donate_argnames`: {fun!r} has no signature to find "
                             "them in; pass `donate_argnums`") from None
        return nums or (), names or ()
    either = [(i, p.name) for i, p in enumerate(params) if p.kind == p.POSITIONAL_OR_KEYWORD]
    if nums is None:
        return tuple(i for i, n in either if n in names), names
    return nums, tuple(n for i, n in either if i in nums)


def _donated_positions(args, kwargs, donate_argnums, donate_argnames=()) -> frozenset[int]:
    """Positions, among the dynamic flat arguments (_split_dynamic), of the donated arguments' leaves:
    those of the positional arguments at `donate_argnums` and the keyword ones in `donate_argnames`,
    as jax.jit donates them (a negative position donates nothing there)."""
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    dyn_flags = [f for x, f in zip(leaves, _donated_flags(args, kwargs, donate_argnums, donate_argnames),
                                   strict=True) if _is_dynamic(x)]
    return frozenset(k for k, f in enumerate(dyn_flags) if f)


def _donated_leaves(args, kwargs, donate_argnums, donate_argnames=()) -> frozenset[int]:
    """Positions, among all flat leaves of (args, kwargs), of the donated arguments' leaves."""
    return frozenset(k for k, f in enumerate(_donated_flags(args, kwargs, donate_argnums, donate_argnames)) if f)


def _donated_flags(args, kwargs, donate_argnums, donate_argnames) -> list[bool]:
    """For each flat leaf of (args, kwargs), whether its argument is donated."""
    nums = set() if donate_argnums is None else {donate_argnums} if isinstance(donate_argnums, int) \
        else set(donate_argnums)
    names = {donate_argnames} if isinstance(donate_argnames, str) else set(donate_argnames or ())
    flags = (tuple(jax.tree_util.tree_map(lambda _, d=i in nums: d, a) for i, a in enumerate(args)),
             {k: jax.tree_util.tree_map(lambda _, d=k in names: d, v) for k, v in kwargs.items()})
    return jax.tree_util.tree_leaves(flags)


def explain(fun: Callable, *args: Any, target=None, tuning=None, **kwargs: Any) -> report_mod.Report:
    """Plan `fun` for `args` (arrays or `jax.ShapeDtypeStruct`s) and report what would be stitched.

    Runs the whole pipeline except execution, including NVRTC, so it works on a CPU-only machine
    given a `target`. `target` and `tuning` are `jit`'s; every other keyword goes to `fun`.
    """
    _check_fun(fun, "jaxstitch.explain")
    tgt = _resolve_target(target, "jaxstitch.explain") or devices.detect()
    if tgt is None:
        raise ValueError("jaxstitch.explain: no CUDA GPU here; pass argument `target` (e.g. target='h100')")
    dyn, static, tree = _split_dynamic(args, kwargs)
    before, t0 = cache.stats(), time.perf_counter()
    program = families.build_any(fun, dyn, tree, tgt, _with_tuning(config.load(), tuning, "jaxstitch.explain"), static)
    seconds, after = time.perf_counter() - t0, cache.stats()
    used = cache.Stats(*(a - b for a, b in zip(dataclasses.astuple(after), dataclasses.astuple(before))))
    return report_mod.make_report(program, used, families.is_symbolic(dyn), seconds)


def disabled_checks() -> list:
    """What `jax.export.export(..., disabled_checks=...)` needs for a stitched function: our custom
    calls are not among those JAX guarantees compatibility for (each carries all it needs: cubin or
    PTX, kernel, launch shape)."""
    return [jax.export.DisabledSafetyCheck.custom_call(t) for t in (ffi.TARGET, ffi.TARGET_PLAIN, xla_kernel.TARGET)]
