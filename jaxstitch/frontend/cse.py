"""Equal equations merged, as XLA's common-subexpression elimination merges them.

A program may compute one value twice: `jnp.where(x * 3 == jnp.max(x * 3, ...))` traces two
multiplies, and a gradient recomputes its primal's ops. XLA runs the program after its CSE pass, so
in jax.jit both copies are one value; split between an XLA kernel and ours (or two of ours, one with
fast math), the copies can differ in their last bits, and an equality between them fail. Merging
them before planning gives both readers one value (which pinned_values.py then keeps computed once
where a comparison needs it), and a kernel fewer ops.
"""
from __future__ import annotations

from typing import Callable, Sequence

from ..core import ir


def merge_equal(eqns: Sequence, outputs: Sequence[ir.Atom], params_key: Callable) -> tuple[list, list, int]:
    """(`eqns` with each equation equal to an earlier one dropped and its results read from the
    earlier one's, `outputs` renamed likewise, how many were dropped). `params_key(eqn)` is a hashable
    form of the params, or None where they cannot be compared (such an equation is kept)."""
    seen: dict[tuple, tuple[ir.Value, ...]] = {}
    rename: dict[int, ir.Value] = {}
    out, dropped = [], 0
    for e in eqns:
        e = ir.reading_renamed(e, rename)
        key = None if e.effectful else _key(e, params_key)
        earlier = seen.get(key) if key is not None else None
        if earlier is not None and all(o.shape == p.shape and o.dtype == p.dtype for o, p in zip(e.outputs, earlier)):
            rename.update((o.id, p) for o, p in zip(e.outputs, earlier))
            dropped += 1
            continue
        if key is not None:
            seen[key] = e.outputs
        out.append(e)
    return out, [ir.renamed(a, rename) for a in outputs], dropped


def _key(e, params_key: Callable) -> tuple | None:
    params = params_key(e)
    if params is None:
        return None
    atoms = tuple(("v", a.id) if isinstance(a, ir.Value) else ("c", repr(a.value), a.dtype) for a in e.inputs)
    return (e.primitive.name, params, atoms, tuple((o.shape, o.dtype) for o in e.outputs))
