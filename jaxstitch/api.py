"""`jaxstitch.jit` and `jaxstitch.explain`: the two things users call."""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Callable

import jax

from . import config, families, report as report_mod, targets
from .kernels import cache, ffi, xla_kernel
from .stitcher import Context, make_runner

log = logging.getLogger("jaxstitch")
_said_fallback = []


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


def jit(fun: Callable | None = None, *, static_argnums=None, static_argnames=None, donate_argnums=None,
        in_shardings=None, out_shardings=None, compiler_options=None, target=None):
    """Like `jax.jit`, with the memory-bound regions of `fun` stitched into our own CUDA kernels.

    On a machine without a CUDA GPU (and no `target`), this is exactly `jax.jit(fun)`.
    `target` ("h100", "h200", ...) plans for that GPU even elsewhere: handy to exercise the whole
    pipeline on a CPU, where the stitched regions then run through XLA. `in_shardings` and
    `out_shardings` are `jax.jit`'s: over several devices, each runs kernels planned for its shards
    (spmd/). `compiler_options` are `jax.jit`'s (XLA debug options for this program), e.g.
    `{"xla_gpu_enable_command_buffer": ""}` to launch its kernels without CUDA graphs.
    """
    if fun is None:
        return functools.partial(jit, static_argnums=static_argnums, static_argnames=static_argnames,
                                 donate_argnums=donate_argnums, in_shardings=in_shardings,
                                 out_shardings=out_shardings, compiler_options=compiler_options,
                                 target=target)
    _check_fun(fun, "jaxstitch.jit")
    tgt = _resolve_target(target, "jaxstitch.jit")
    jit_kwargs = dict(static_argnums=static_argnums, static_argnames=static_argnames,
                      donate_argnums=donate_argnums)
    for name, val in (("in_shardings", in_shardings), ("out_shardings", out_shardings),
                      ("compiler_options", compiler_options)):
        if val is not None:  # (jax.jit's own default is a sentinel, so only pass what was given)
            jit_kwargs[name] = val
    cfg = config.load()
    if cfg.disabled:
        return jax.jit(fun, **jit_kwargs)
    from .kernels import availability  # (what is missing here, said once a process with its fix)
    tgt = availability.usable_target(tgt)
    if tgt is None:
        return jax.jit(fun, **jit_kwargs)

    @functools.wraps(fun)
    def stitched(*args, **kwargs):
        dyn, static, tree = _split_dynamic(args, kwargs)
        program = families.build_any(fun, dyn, tree, tgt, cfg, static)
        donated = _donated_positions(args, kwargs, donate_argnums)
        outs = make_runner(program, Context(tgt, cfg), donated)(*dyn)
        return jax.tree_util.tree_unflatten(program.traced.out_tree, outs)

    return jax.jit(stitched, **jit_kwargs)


def _donated_positions(args, kwargs, donate_argnums) -> frozenset[int]:
    """Positions, among the dynamic flat arguments (_split_dynamic), of the donated arguments' leaves."""
    if donate_argnums is None:
        return frozenset()
    nums = {donate_argnums} if isinstance(donate_argnums, int) else set(donate_argnums)
    nums = {n % len(args) for n in nums if -len(args) <= n < len(args)}
    flags = (tuple(jax.tree_util.tree_map(lambda _, d=i in nums: d, a) for i, a in enumerate(args)),
             jax.tree_util.tree_map(lambda _: False, kwargs))
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    dyn_flags = [f for x, f in zip(leaves, jax.tree_util.tree_leaves(flags), strict=True)
                 if _is_dynamic(x)]
    return frozenset(k for k, f in enumerate(dyn_flags) if f)


def explain(fun: Callable, *args: Any, target=None, **kwargs: Any) -> report_mod.Report:
    """Plan `fun` for `args` (arrays or `jax.ShapeDtypeStruct`s) and report what would be stitched.

    Runs the whole pipeline except execution, including NVRTC, so it works on a CPU-only machine
    given a `target`.
    """
    _check_fun(fun, "jaxstitch.explain")
    tgt = _resolve_target(target, "jaxstitch.explain") or targets.detect()
    if tgt is None:
        raise ValueError("jaxstitch.explain: no CUDA GPU here; pass argument `target` (e.g. target='h100')")
    dyn, static, tree = _split_dynamic(args, kwargs)
    before, t0 = cache.stats(), time.perf_counter()
    program = families.build_any(fun, dyn, tree, tgt, config.load(), static)
    seconds, after = time.perf_counter() - t0, cache.stats()
    used = cache.Stats(*(a - b for a, b in zip(dataclasses.astuple(after), dataclasses.astuple(before))))
    return report_mod.make_report(program, used, families.is_symbolic(dyn), seconds)


def disabled_checks() -> list:
    """What `jax.export.export(..., disabled_checks=...)` needs for a stitched function: our custom
    calls are not among those JAX guarantees compatibility for (each carries all it needs: cubin or
    PTX, kernel, launch shape)."""
    return [jax.export.DisabledSafetyCheck.custom_call(t) for t in (ffi.TARGET, ffi.TARGET_PLAIN, xla_kernel.TARGET)]
