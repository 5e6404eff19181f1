"""The graph jaxstitch plans over: a flat, frozen, hashable copy of an (inlined) jaxpr.

Everything after tracing works on these dataclasses only, so planning and codegen are pure functions
that never touch JAX internals and can be tested without a GPU.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Union


@dataclasses.dataclass(frozen=True)
class Value:
    """An SSA value (a jaxpr variable): id, shape and dtype name (numpy spelling)."""

    id: int
    shape: tuple[int, ...]
    dtype: str

    @functools.cached_property
    def size(self) -> int:  # (cached: partitioning asks it about a million times of GPT's step)
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize


@dataclasses.dataclass(frozen=True)
class Const:
    """A scalar literal operand (jaxpr Literal)."""

    value: Any
    dtype: str


Atom = Union[Value, Const]


@dataclasses.dataclass(frozen=True)
class Op:
    """One primitive application. `index` is its position in the traced equation list."""

    index: int
    prim: str
    inputs: tuple[Atom, ...]
    outputs: tuple[Value, ...]
    params: tuple[tuple[str, Any], ...]

    def param(self, name: str, default: Any = None) -> Any:
        for key, val in self.params:
            if key == name:
                return val
        return default


@dataclasses.dataclass(frozen=True)
class Graph:
    inputs: tuple[Value, ...]
    outputs: tuple[Atom, ...]
    ops: tuple[Op, ...]


DTYPE_BYTES = {
    "float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "uint32": 4, "bool": 1,
    "float64": 8, "int64": 8, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
HALF_DTYPES = ("bfloat16", "float16")  # computed in float, rounded on store
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16", "int32", "uint32", "bool")


def values_by_id(graph: Graph) -> dict[int, Value]:
    """Every value of the graph (its inputs, what its ops read and write, captured constants) by id."""
    found = {v.id: v for v in graph.inputs}
    for op in graph.ops:
        found.update((v.id, v) for v in op.inputs + op.outputs if isinstance(v, Value))
    return found


def renamed(a: Atom, rename: dict[int, Atom]) -> Atom:
    """`a`, or what `rename` maps its value's id to (a rewrite that drops an equation reads its
    results from another value)."""
    return rename.get(a.id, a) if isinstance(a, Value) else a


def reading_renamed(node, rename: dict[int, Atom]):
    """`node` (an op or equation: a dataclass with `inputs`) reading its inputs through `rename`."""
    inputs = tuple(renamed(a, rename) for a in node.inputs)
    return node if inputs == tuple(node.inputs) else dataclasses.replace(node, inputs=inputs)


def live(nodes, outputs, keep=lambda node: False) -> tuple:
    """The nodes (ops or equations: anything with `inputs` and `outputs`, in program order) that
    `outputs` depend on, and those `keep` says to keep regardless."""
    needed = {a.id for a in outputs if isinstance(a, Value)}
    kept = []
    for n in reversed(nodes):
        if keep(n) or any(o.id in needed for o in n.outputs):
            kept.append(n)
            needed.update(a.id for a in n.inputs if isinstance(a, Value))
    return tuple(reversed(kept))
