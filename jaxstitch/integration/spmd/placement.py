"""Which mesh axes split each factor, from the shardings XLA's partitioner chose for a region's inputs.

A dimension sharded over mesh axes (x, y) is cut into contiguous tiles; over a dimension made of
factors [a, b] (a reshape's merge, major first) that is a split of `a`, continuing into `b` only
once `a` is down to one element per device. Shardings that cannot be read that way, that split a
pinned factor, that do not divide a factor evenly, or that give one mesh axis to two factors, are
dropped: XLA then gathers that input, which is correct, and `dropped` says why. Pure.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from ...core import ir
from .factors import Factors

Spec = tuple[tuple[str, ...], ...]  # per dimension, the mesh axes splitting it (major first)


@dataclasses.dataclass(frozen=True)
class Placement:
    axes: tuple[tuple[str, ...], ...]  # per factor
    inputs: tuple[Spec, ...]
    outputs: tuple[Spec, ...]
    dropped: tuple[str, ...]

    @property
    def sharded(self) -> bool:
        return any(self.axes)


def place(factors: Factors, inputs: Sequence[ir.Value], specs: Sequence[Spec], outputs: Sequence[ir.Atom],
          mesh: Mapping[str, int], out_specs: Sequence[Spec] = ()) -> Placement:
    """The split of each factor: the inputs' shardings first, then the outputs' (`out_specs`, as the
    partitioner propagated them from the readers: a dropout mask drawn from a replicated key has no
    sharded input but is wanted per batch shard)."""
    axes: dict[int, tuple[str, ...]] = {}
    dropped = []
    given = [(f"input {i}", v, s) for i, (v, s) in enumerate(zip(inputs, specs))]
    given += [(f"output {j}", v, s) for j, (v, s) in enumerate(zip(outputs, out_specs)) if isinstance(v, ir.Value)]
    for what, v, spec in given:
        for d, (dim_factors, dim_axes) in enumerate(zip(factors.of(v), spec)):
            if not dim_axes:
                continue
            split, why = _split_dim(factors, dim_factors, dim_axes, mesh)
            if why is None:
                taken = {a for f, fa in axes.items() if f not in split for a in fa}
                if any(axes.get(f, fa) != fa for f, fa in split.items()):
                    why = "its factor is split otherwise by another operand"
                elif taken & {a for fa in split.values() for a in fa}:
                    why = "its mesh axes already split another factor"
            if why is None:
                axes.update(split)
            else:
                dropped.append(f"{what} dimension {d} over {dim_axes}: {why}")
    values = list(inputs) + [o for o in outputs if isinstance(o, ir.Value)]
    while True:  # a value's dimension that is no tile of the device grid gives its factor back
        bad = [f for v in values for dim in factors.of(v) for f in _untiled(dim, axes, factors, mesh)]
        if not bad:
            break
        for f in dict.fromkeys(bad):
            dropped.append(f"factor {f} over {axes.pop(f)}: some value's tile would not be contiguous")
    per_factor = tuple(axes.get(f, ()) for f in range(len(factors.sizes)))
    return Placement(per_factor, tuple(spec_of(factors, per_factor, v) for v in inputs),
                     tuple(spec_of(factors, per_factor, o) if isinstance(o, ir.Value) else () for o in outputs),
                     tuple(dropped))


def _split_dim(factors: Factors, dim: tuple[int, ...], dim_axes: tuple[str, ...], mesh):
    """{factor: axes} for one dimension's tiles, or a reason they fit no factor."""
    split: dict[int, list[str]] = {}
    it = iter(dim)
    f = next(it, None)
    left = factors.sizes[f] if f is not None else 1
    for a in dim_axes:
        n = mesh[a]
        if n == 1:
            continue
        while f is not None and left == 1:
            f = next(it, None)
            left = factors.sizes[f] if f is not None else 1
        if f is None or left % n:
            return {}, f"{math.prod(mesh[x] for x in dim_axes)} devices do not divide it evenly"
        if f in factors.pinned:
            return {}, "an op in the region needs it whole (a slice, scan or reduction along it)"
        split.setdefault(f, []).append(a)
        left //= n
    return {f: tuple(a) for f, a in split.items()}, None


def _untiled(dim: tuple[int, ...], axes, factors: Factors, mesh) -> list[int]:
    """Factors of `dim` split while a more major factor of it is not split down to one element."""
    above_split_to_one = True
    bad = []
    for f in dim:
        if f in axes and not above_split_to_one:
            bad.append(f)
        local = factors.sizes[f] // math.prod(mesh[a] for a in axes.get(f, ()))
        above_split_to_one = above_split_to_one and local == 1
    return bad


def spec_of(factors: Factors, axes, v: ir.Value) -> Spec:
    return tuple(tuple(a for f in dim for a in axes[f]) for dim in factors.of(v))


def local_shape(factors: Factors, axes, v: ir.Value, mesh) -> tuple[int, ...]:
    return tuple(math.prod(factors.sizes[f] // math.prod(mesh[a] for a in axes[f]) for f in dim)
                 for dim in factors.of(v))
