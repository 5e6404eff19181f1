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

`JAXSTITCH_TUNE=batched_folds=N`: 0 none; 1 (the default) only the folds that open a value to our
regions (`fold_batched`'s OPENING: a product's transpose that an op computing with it reads, as
BERT's bias gradients do); 2 every fold. Measured (H100, GPU busy time a step, CUPTI, 3 rounds, one
process each): GPT bfloat16 11.63-11.69 ms with none, 11.70-11.73 with every fold (XLA moves its
transposes between kernels); 1 folds nothing there. BERT float32 18.11-18.15 ms
with none, 17.97-18.11 with 1, 17.78-17.84 with 2 (two runs; every fold gains more in
BERT, loses in GPT, and the operand folds alone gain nothing: 18.18); BERT bfloat16 9.61 against
9.62 with 1. With every fold and `product_concats=1`, GPT's rotary backward becomes ours: 11.81 ms
(its 12 kernels at ~51% of their roofline, while XLA's kernels lose only 76 us).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Sequence

from ..core import ir
from ..core import ops as opdefs
from .transposed_products import count_users, readers_by_id, swappable, swapped_product

FOLDED = "batched products reordered"  # the report's name for the transposes this module removes


OPENING, EVERY = 1, 2  # batched_folds: the folds that open a value to our regions; every fold


def fold_batched(eqns: Sequence, outputs: Sequence[ir.Atom],
                 new_value: Callable[[tuple, str], ir.Value], which: int = EVERY) -> tuple[list, int]:
    """`eqns` (trace.Eqn, in program order) with batched products' minor-axis transposes folded as
    the module says, and how many transposes were folded; `new_value(shape, dtype)` makes a value
    for a swapped product whose result is still transposed. `which`: EVERY fold, or OPENING: only a
    product's transpose whose result an op that computes reads (_computed_with), which no region of
    ours could read before the fold; elsewhere the transpose is XLA's either way, and moving it
    between XLA's kernels gained nothing (GPT)."""
    eqns, n_out = _fold_outputs(list(eqns), outputs, new_value, which == OPENING)
    n_in = 0
    if which == EVERY:
        eqns, n_in = _fold_operands(eqns, outputs)
    return eqns, n_out + n_in


def _computed_with(vid: int, read_by: dict, outputs) -> bool:
    """Whether an op that computes (not a product, not a data-moving op) or a program output reads
    value `vid`, through reshapes. Products read a transpose in XLA's kernels either way, and XLA
    fuses a transpose into the slices and concatenations that read it (GPT's rotary backward)."""
    if any(isinstance(a, ir.Value) and a.id == vid for a in outputs):
        return True
    for e in read_by.get(vid, ()):
        name = e.primitive.name
        if name == "reshape":
            if _computed_with(e.outputs[0].id, read_by, outputs):
                return True
        elif name not in opdefs.COMPUTE_BOUND and name not in opdefs.VIEWS:
            return True
    return False


def _fold_outputs(eqns: list, outputs, new_value, opening_only: bool = False) -> tuple[list, int]:
    users = count_users(eqns, outputs)
    producer = {o.id: i for i, e in enumerate(eqns) for o in e.outputs}
    read_by = readers_by_id(eqns) if opening_only else {}
    replaced: dict[int, list] = {}  # transpose's index -> the equations written for it
    for i, e in enumerate(eqns):
        if e.primitive.name != "transpose" or not isinstance(e.inputs[0], ir.Value):
            continue
        p = producer.get(e.inputs[0].id)
        if p is None or users[e.inputs[0].id] != 1 or not _foldable(eqns[p]):
            continue
        if opening_only and not _computed_with(e.outputs[0].id, read_by, outputs):
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
