"""`jaxstitch.nnx.jit`: `jaxstitch.jit` for functions of Flax NNX objects, like `flax.nnx.jit`.

NNX modules and optimizers are mutable Python objects; a train step updates their Variables (the
parameters, the optimizer state, BatchNorm statistics, RNG counters) in place. `jaxstitch.jit` needs
a pure function of arrays, so this wrapper does what `nnx.jit` does around `jax.jit`: split the NNX
objects among the arguments into a static graph definition and a state of arrays, run the stitched
pure function, and write the new state back into the objects. Objects shared between arguments are
split together, so they stay shared. As with `nnx.jit`, nothing is donated unless asked for
(`donate_argnums`/`donate_argnames`): a donated object's arrays read before the call are deleted
after it (the object itself holds the new ones), which saves a train step a copy of its state.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable

from . import api

_WHO = "jaxstitch.nnx.jit"


def jit(fun: Callable | None = None, *, in_shardings=None, out_shardings=None, static_argnums=None,
        static_argnames=None, donate_argnums=None, donate_argnames=None, keep_unused: bool = False,
        device=None, backend=None, inline=False, graph=None, graph_updates=None, compiler_options=None,
        target=None, guard=None, tuning=None):
    """Stitch `fun(*args, **kwargs)`, whose arguments may be NNX objects (modules, optimizers,
    `nnx.Rngs`), updating those objects in place. Results must not hold NNX objects.

    The options are `flax.nnx.jit`'s, with their defaults: `static_argnums`/`static_argnames`,
    `donate_argnums`/`donate_argnames` (opt-in: a donated NNX object's state buffers are given to
    the step, and arrays read from it before the call are deleted after it; a donated buffer may be
    written over in place by a kernel), `out_shardings`, `keep_unused`, `device`, `backend`,
    `inline`; `graph` and `graph_updates` may only be left as they are or True (this always splits
    in graph mode and writes updates back). `in_shardings` is refused: place the arrays (e.g.
    `jax.device_put` of the state) and the call follows their shardings. `compiler_options`,
    `target`, `guard` and `tuning` are `jaxstitch.jit`'s.
    """
    options = dict(in_shardings=in_shardings, out_shardings=out_shardings, static_argnums=static_argnums,
                   static_argnames=static_argnames, donate_argnums=donate_argnums,
                   donate_argnames=donate_argnames, keep_unused=keep_unused, device=device, backend=backend,
                   inline=inline, graph=graph, graph_updates=graph_updates,
                   compiler_options=compiler_options, target=target, guard=guard, tuning=tuning)
    if fun is None:
        return functools.partial(jit, **options)
    api._check_fun(fun, _WHO)
    _refuse_unsupported(in_shardings, graph, graph_updates)
    roles = _Roles(api._argnums_and_names(fun, static_argnums, static_argnames, "static", _WHO),
                   api._argnums_and_names(fun, donate_argnums, donate_argnames, "donate", _WHO),
                   _labels_of(fun))
    stitched = api.jit(_pure(fun), static_argnums=(0, 1, 2), donate_argnums=(3,), keep_unused=keep_unused,
                       device=device, backend=backend, inline=inline, compiler_options=compiler_options,
                       out_shardings=None if out_shardings is None else (out_shardings, None), target=target,
                       guard=guard, tuning=tuning)

    @functools.wraps(fun)
    def wrapper(*args, **kwargs):
        from flax import nnx

        layout, static, values = roles.split(args, kwargs)
        dynamic = [entry for entry in layout if entry[2] != "static"]  # (`values` are theirs)
        nodes = tuple(v for (_, _, kind, _), v in zip(dynamic, values) if kind == "node")
        # one state per object (an object shared with an earlier one is in the earlier one's state)
        graphdef, *states, _ = nnx.split(nodes, *map(_at, range(len(nodes))), ...)
        states = iter(states)
        donated, kept = {}, {}
        for (_, label, kind, give), v in zip(dynamic, values, strict=True):
            (donated if give else kept)[label] = next(states) if kind == "node" else v
        out, new_state = stitched(graphdef, layout, static, donated, kept)
        if nodes:
            nnx.update(nodes, new_state)
        return out

    return wrapper


def _refuse_unsupported(in_shardings, graph, graph_updates) -> None:
    if in_shardings is not None:
        raise NotImplementedError(f"{_WHO}: argument `in_shardings` is not supported; place the arrays "
                                  "(e.g. jax.device_put of the state) and the call follows their shardings")
    for name, val in (("graph", graph), ("graph_updates", graph_updates)):
        if val is not None and not val:
            raise NotImplementedError(f"{_WHO}: argument `{name}={val!r}` is not supported: NNX objects "
                                      "are always split in graph mode, with their updates written back")


def _at(j: int) -> Callable:
    """The nnx filter of the state under the `j`th of the split objects."""
    return lambda path, _: path[0] == j


def _labels_of(fun: Callable) -> tuple[tuple[str, ...], str]:
    """The names of `fun`'s positional parameters and of its `*args` ("args" if none), to name the
    arguments in jax's errors as jax.jit names them."""
    try:
        params = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        return (), "args"
    positional = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    return positional, next((p.name for p in params if p.kind == p.VAR_POSITIONAL), "args")


@dataclasses.dataclass(frozen=True)
class _Roles:
    """Which arguments are static and which donated ((positions, names) of each), and `fun`'s
    parameter names (_labels_of)."""

    static: tuple[tuple[int, ...], tuple[str, ...]]
    donate: tuple[tuple[int, ...], tuple[str, ...]]
    labels: tuple[tuple[str, ...], str]

    def label(self, key: int | str) -> str:
        if isinstance(key, str):
            return key
        positional, rest = self.labels
        return positional[key] if key < len(positional) else f"{rest}[{key - len(positional)}]"

    def split(self, args, kwargs) -> tuple[tuple, tuple, list]:
        """(layout, static values, other values) of a call: `layout` has, for each argument, its
        position or name, its label (its parameter's name), whether it is "static", an NNX object
        ("node") or a "plain" value, and whether it is donated; the other values follow it."""
        from flax.nnx.graph import is_graph_node

        layout, static, values = [], [], []
        for key, val in [*enumerate(args), *kwargs.items()]:
            named = isinstance(key, str)
            if key in self.static[named] or (not named and key - len(args) in self.static[0]):
                layout.append((key, self.label(key), "static", False))
                static.append(val)
                continue
            give = key in self.donate[named]  # (a negative position donates nothing, as in jax.jit)
            layout.append((key, self.label(key), "node" if is_graph_node(val) else "plain", give))
            values.append(val)
        labels = [entry[1] for entry in layout]
        if len(set(labels)) != len(labels):
            twice = next(x for x in labels if labels.count(x) > 1)
            raise TypeError(f"{_WHO}: got multiple values for argument {twice!r}")
        return tuple(layout), tuple(static), values


def _pure(fun: Callable) -> Callable:
    """`fun` as a pure function of (graphdef, layout, static values, donated, kept) (the wrapper's
    split) returning its result and the objects' new state; named after `fun` in jax's errors."""
    def pure(graphdef, layout, static, donated, kept):
        from flax import nnx

        states = [(donated if give else kept)[label] for _, label, kind, give in layout if kind == "node"]
        nodes = nnx.merge(graphdef, *states) if states else ()
        merged, statics = iter(nodes), iter(static)
        args, kwargs = [], {}
        for key, label, kind, give in layout:
            val = (next(statics) if kind == "static" else next(merged) if kind == "node"
                   else (donated if give else kept)[label])
            if isinstance(key, str):
                kwargs[key] = val
            else:
                args.append(val)
        out = fun(*args, **kwargs)
        return out, (nnx.split(nodes)[1] if states else None)

    pure.__signature__ = inspect.signature(pure)
    pure.__wrapped__ = fun  # (jax names the function an error is in after what this unwraps to)
    return pure
