"""Transposes of transposes composed into one, as XLA's algebraic simplifier composes them.

A gradient transposes back what its forward pass transposed (attention's heads: `(0, 2, 1, 3)` and
back), and JAX traces both. XLA composes `transpose(transpose(x, p), q)` into `transpose(x, p[q])`,
and drops it where that is the identity. Our regions saw the pair as written: a lone transpose left
to XLA, and a region reading the second one's strided view of the first, unplannable ("walks its
minor axis with stride N (a transpose)"), where the composed read is the array itself. So the trace
composes them first: the second reads the first's operand with the composed permutation, or, where
that is the identity, its readers read the operand itself (the first stays only for other readers).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from ..core import ir

REPORTED = "transposes of transposes composed"  # the report's name for the rewritten equations


def compose(eqns: Sequence, outputs: Sequence[ir.Atom]) -> tuple[list, list, int]:
    """(`eqns` with each transpose of a transpose's result reading the first one's operand, composed,
    and dropped where the composition is the identity, `outputs` renamed likewise, how many)."""
    source: dict[int, tuple[ir.Value, tuple[int, ...]]] = {}  # a transpose's result -> (operand, perm)
    rename: dict[int, ir.Atom] = {}
    out, composed = [], 0
    for e in eqns:
        e = ir.reading_renamed(e, rename)
        if e.primitive.name != "transpose" or not isinstance(e.inputs[0], ir.Value) or e.effectful:
            out.append(e)
            continue
        perm = tuple(e.params["permutation"])
        origin = source.get(e.inputs[0].id)
        if origin is not None:
            base, first = origin
            perm = tuple(first[i] for i in perm)
            composed += 1
            if perm == tuple(range(len(perm))):
                rename[e.outputs[0].id] = base
                continue
            e = dataclasses.replace(e, inputs=(base,), params={**e.params, "permutation": perm})
        source[e.outputs[0].id] = (e.inputs[0], perm)
        out.append(e)
    return out, [ir.renamed(a, rename) for a in outputs], composed
