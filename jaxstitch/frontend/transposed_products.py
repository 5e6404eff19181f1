"""A transposed matrix product written as the product of its operands swapped.

Autodiff writes a weight's gradient as `transpose(dot_general(dy, x))`: the product in the order its
cotangent rule builds it, then a transpose into the weight's layout. For jax.jit's program XLA folds
the transpose into the product (cuBLAS writes either orientation). In a program with merged
products (merged_products.py) it did not: GPT bfloat16's compiled HLO (H100) ran every
down projection's AdamW update as a transposing fusion (12 x 68 us, reading the weight, both
moments and the split-K gradient in the other orientation, and a copy after), where jax.jit's
reads them in place (~17 us of bytes each). Folded here (and the merged product's halves read in
place, recompute.py), XLA's other kernels took 2.74 ms of the step instead of 3.69. Applied only
where products merge (trace._merged): elsewhere XLA folds them itself, and GPT float32 with every
such transpose folded measured 1% slower (one process, 3 rounds).

Written here, the product itself has the transpose's output: `dot_general(x, dy)` with the
dimension numbers swapped. Only where the product has no batch axes, the transpose only swaps the
two operands' free axes, and nothing else reads the product. The same sums in the same dtype, so
the result is the same up to cuBLAS's order of accumulation.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

from ..core import ir

FOLDED = "transposed products folded"  # the report's name for the transposes this module removes


def fold_transposes(eqns: Sequence, outputs: Sequence[ir.Atom]) -> tuple[list, int]:
    """`eqns` (trace.Eqn, in program order) with each foldable transpose of a product replaced by
    the swapped product, and how many were folded."""
    users = count_users(eqns, outputs)
    producer = {o.id: i for i, e in enumerate(eqns) for o in e.outputs}
    swapped: dict[int, object] = {}  # transpose's index -> the swapped product
    for i, e in enumerate(eqns):
        if e.primitive.name != "transpose" or not isinstance(e.inputs[0], ir.Value):
            continue
        p = producer.get(e.inputs[0].id)
        if p is None or users[e.inputs[0].id] != 1:
            continue
        product = eqns[p]
        if _swaps_operands(product, tuple(e.params["permutation"])):
            swapped[i] = swapped_product(product, e.outputs)
    if not swapped:
        return list(eqns), 0
    gone = {producer[eqns[i].inputs[0].id] for i in swapped}
    return [swapped.get(i, e) for i, e in enumerate(eqns) if i not in gone], len(swapped)


def count_users(eqns: Sequence, outputs: Sequence[ir.Atom]) -> collections.Counter:
    """How many equations (and program outputs) read each value, by id."""
    users = collections.Counter(a.id for e in eqns for a in e.inputs if isinstance(a, ir.Value))
    users.update(a.id for a in outputs if isinstance(a, ir.Value))
    return users


def readers_by_id(eqns: Sequence) -> dict[int, list]:
    """The equations reading each value, by id, in program order."""
    read_by = collections.defaultdict(list)
    for e in eqns:
        for a in e.inputs:
            if isinstance(a, ir.Value):
                read_by[a.id].append(e)
    return read_by


def swappable(product) -> bool:
    """A dot_general over two values, as written (no sharding: a sharding names the axes as they
    are), whose operands may be swapped."""
    return (product.primitive.name == "dot_general" and len(product.inputs) == 2 and not product.effectful
            and all(isinstance(a, ir.Value) for a in product.inputs)
            and product.params.get("out_sharding") is None)


def _swaps_operands(product, permutation: tuple[int, ...]) -> bool:
    """Whether `product` is a dot_general without batch axes and `permutation` puts its rhs's free
    axes before its lhs's, each in order."""
    if not swappable(product):
        return False
    (lc, rc), (lb, rb) = product.params["dimension_numbers"]
    if lb or rb:
        return False
    n_lhs = len(product.inputs[0].shape) - len(lc)
    n_rhs = len(product.inputs[1].shape) - len(rc)
    return permutation == tuple(range(n_lhs, n_lhs + n_rhs)) + tuple(range(n_lhs))


def swapped_product(product, outputs):
    """`product` with its operands (and their dimension numbers and precisions) swapped, writing
    `outputs`: its result has the rhs's free axes before the lhs's (batch axes first, as before)."""
    (lc, rc), (lb, rb) = product.params["dimension_numbers"]
    params = dict(product.params, dimension_numbers=((tuple(rc), tuple(lc)), (tuple(rb), tuple(lb))))
    precision = params.get("precision")
    if isinstance(precision, tuple) and len(precision) == 2:
        params["precision"] = precision[::-1]
    return dataclasses.replace(product, params=params, inputs=product.inputs[::-1], outputs=tuple(outputs))
