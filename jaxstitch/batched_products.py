"""Batched matrix products (attention's) written so the minor axis of what they feed stays in place.

`jnp.einsum` and autodiff write an attention's products in whatever operand order their contraction
path gives, and transpose after: GPT's value gradient is `transpose(dot_general(do^T, probs),
(0, 3, 1, 2))`, [b, h, d, k] -> [b, k, h, d], with `do^T = transpose(do, (0, 2, 3, 1))`. Both
transposes move the minor axis: no region of ours can read them (plan/views.py), and XLA runs each as
a transposing kernel of its own, in jax.jit's program as well (GPT bfloat16, H100: `input_transpose_
fusion` and `wrapped_transpose`, 12 each a step).

Here

- `transpose(dot_general(a, b))` whose permutation makes the last of a's free axes minor becomes
  `dot_general(b, a)`, whose minor axis that is, and a transpose of the major axes only (none if the
  permutation was just the swap): a region reads that through a view, in place;
- `dot_general(transpose(x), y)` reads `x` with the dimension numbers mapped through the
  permutation, where that keeps the order of the operand's free axes (so the product is unchanged).

Only products with batch axes, operands that are values, and no sharding. The same sums in the same
dtype: the results are the same up to the products' order of accumulation.

Off by default (`JAXSTITCH_TUNE=batched_folds=1`). Measured (H100, session 43, one process each):
GPT bfloat16's step busy 11.63 -> 11.63-11.73 ms (XLA moves its transposes between kernels; the
rotary backward they were meant to open to us stays XLA's, its kernel too large for the device's
NVRTC; built as ours with the register cap lifted, the step took 11.86 ms); BERT float32's busy
18.17 -> 17.81 ms (its value gradient's bias reductions become ours), one measurement of three
rounds.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Sequence

from . import ir
from .transposed_products import count_users, swappable, swapped_product

FOLDED = "batched products reordered"  # the report's name for the transposes this module removes


def fold_batched(eqns: Sequence, outputs: Sequence[ir.Atom],
                 new_value: Callable[[tuple, str], ir.Value]) -> tuple[list, int]:
    """`eqns` (trace.Eqn, in program order) with batched products' minor-axis transposes folded as
    the module says, and how many transposes were folded; `new_value(shape, dtype)` makes a value
    for a swapped product whose result is still transposed."""
    eqns, n_out = _fold_outputs(list(eqns), outputs, new_value)
    eqns, n_in = _fold_operands(eqns, outputs)
    return eqns, n_out + n_in


def _fold_outputs(eqns: list, outputs, new_value) -> tuple[list, int]:
    users = count_users(eqns, outputs)
    producer = {o.id: i for i, e in enumerate(eqns) for o in e.outputs}
    replaced: dict[int, list] = {}  # transpose's index -> the equations written for it
    for i, e in enumerate(eqns):
        if e.primitive.name != "transpose" or not isinstance(e.inputs[0], ir.Value):
            continue
        p = producer.get(e.inputs[0].id)
        if p is None or users[e.inputs[0].id] != 1 or not _foldable(eqns[p]):
            continue
        perm = _swapped_permutation(eqns[p], tuple(e.params["permutation"]))
        if perm is None:
            continue
        if perm == tuple(range(len(perm))):
            replaced[i] = [swapped_product(eqns[p], e.outputs)]
            continue
        out = e.outputs[0]
        mid = new_value(tuple(out.shape[perm.index(d)] for d in range(len(perm))), out.dtype)
        replaced[i] = [swapped_product(eqns[p], (mid,)),
                       dataclasses.replace(e, params=dict(e.params, permutation=perm), inputs=(mid,))]
    if not replaced:
        return eqns, 0
    gone = {producer[eqns[i].inputs[0].id] for i in replaced}
    out: list = []
    for i, e in enumerate(eqns):
        if i not in gone:
            out.extend(replaced.get(i, [e]))
    return out, len(replaced)


def _fold_operands(eqns: list, outputs) -> tuple[list, int]:
    users = count_users(eqns, outputs)
    producer = {o.id: e for e in eqns for o in e.outputs}
    reads = collections.defaultdict(list)  # transpose's result -> (product's index, side, dimension numbers)
    for i, e in enumerate(eqns):
        if not _foldable(e):
            continue
        for side in (0, 1):
            t = producer.get(e.inputs[side].id)
            if t is not None and t.primitive.name == "transpose" and isinstance(t.inputs[0], ir.Value):
                mapped = _through(e, side, tuple(t.params["permutation"]))
                if mapped is not None:
                    reads[e.inputs[side].id].append((i, side, mapped))
    folded = 0
    for vid, uses in reads.items():
        if len(uses) != users[vid] or len({i for i, _, _ in uses}) != len(uses):
            continue  # (read by something else too, or as both operands: the transpose stays anyway)
        for i, side, mapped in uses:
            e = eqns[i]
            inputs = list(e.inputs)
            inputs[side] = producer[vid].inputs[0]
            eqns[i] = dataclasses.replace(e, params=dict(e.params, dimension_numbers=mapped),
                                          inputs=tuple(inputs))
            folded += 1
    if not folded:
        return eqns, 0
    live = {a.id for e in eqns for a in e.inputs if isinstance(a, ir.Value)}
    live.update(a.id for a in outputs if isinstance(a, ir.Value))
    return [e for e in eqns if e.primitive.name != "transpose" or e.outputs[0].id in live], folded


def _foldable(product) -> bool:
    """A swappable dot_general (transposed_products.swappable) with batch axes."""
    return swappable(product) and bool(product.params["dimension_numbers"][1][0])


def _counts(product) -> tuple[int, int, int]:
    """(batch, lhs free, rhs free) axes of a dot_general's result, in that order."""
    (lc, rc), (lb, _) = product.params["dimension_numbers"]
    nb = len(lb)
    return nb, len(product.inputs[0].shape) - len(lc) - nb, len(product.inputs[1].shape) - len(rc) - nb


def _swapped_permutation(product, perm: tuple[int, ...]) -> tuple[int, ...] | None:
    """The permutation of the swapped product's result giving `perm` of the product's, where `perm`
    makes the last of the lhs's free axes minor (after the swap, the product's own minor axis)."""
    nb, nl, nr = _counts(product)
    if not nl or not nr or perm[-1] != nb + nl - 1:
        return None
    where = [d if d < nb else d + nr if d < nb + nl else d - nl for d in range(nb + nl + nr)]
    return tuple(where[p] for p in perm)


def _through(product, side: int, perm: tuple[int, ...]):
    """The product's dimension numbers with operand `side` read before its transpose by `perm`, or
    None where its free axes would come out in another order."""
    (lc, rc), (lb, rb) = product.params["dimension_numbers"]
    contract, batch = (lc, rc)[side], (lb, rb)[side]
    free = [d for d in range(len(perm)) if d not in contract and d not in batch]
    if [perm[d] for d in free] != sorted(perm[d] for d in free):
        return None
    contract, batch = tuple(perm[d] for d in contract), tuple(perm[d] for d in batch)
    if side == 0:
        return (contract, tuple(rc)), (batch, tuple(rb))
    return (tuple(lc), contract), (tuple(lb), batch)
