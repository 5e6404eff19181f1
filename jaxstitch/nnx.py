"""`jaxstitch.nnx.jit`: `jaxstitch.jit` for functions of Flax NNX objects, like `flax.nnx.jit`.

NNX modules and optimizers are mutable Python objects; a train step updates their Variables (the
parameters, the optimizer state, BatchNorm statistics, RNG counters) in place. `jaxstitch.jit` needs
a pure function of arrays, so this wrapper does what `nnx.jit` does around `jax.jit`: split the NNX
objects among the arguments into a static graph definition and a state of arrays, run the stitched
pure function, and write the new state back into the objects. Objects shared between arguments are
split together, so they stay shared. The state is donated (as in-place training expects): arrays
read from the objects before the call are stale after it.
"""
from __future__ import annotations

import functools
from typing import Callable

from . import api


def jit(fun: Callable | None = None, *, donate: bool = True, target=None):
    """Stitch `fun(*args, **kwargs)`, whose arguments may be NNX objects (modules, optimizers,
    `nnx.Rngs`), updating those objects in place. Results must not hold NNX objects."""
    if fun is None:
        return functools.partial(jit, donate=donate, target=target)
    from flax import nnx
    from flax.nnx.graph import is_graph_node

    def pure(graphdef, state, where, args, kwargs):
        nodes = iter(nnx.merge(graphdef, state))
        args = [next(nodes) if w else a for w, a in zip(where, args)]
        out = fun(*args, **kwargs)
        _, new_state = nnx.split(tuple(a for w, a in zip(where, args) if w))
        return out, new_state

    stitched = api.jit(pure, static_argnums=(0, 2), donate_argnums=(1,) if donate else None, target=target)

    @functools.wraps(fun)
    def wrapper(*args, **kwargs):
        where = tuple(is_graph_node(a) for a in args)
        nodes = tuple(a for w, a in zip(where, args) if w)
        graphdef, state = nnx.split(nodes)
        plain = tuple(None if w else a for w, a in zip(where, args))
        out, new_state = stitched(graphdef, state, where, plain, kwargs)
        nnx.update(nodes, new_state)
        return out

    return wrapper
