"""Matrix products over one shared operand, or summed, written as one product of concatenations.

A SwiGLU MLP computes x Wg and x Wu. Its backward pass computes dWg = x^T dg and dWu = x^T du (one
operand shared) and dx = dg Wg^T + du Wu^T (a sum of products). XLA's dot merger joins products
that share an operand, but after fusion: it copies dg and du into [dg | du] with a kernel of its
own, since dx's products read each of them too, and it never joins a sum. GPT bfloat16 on an H100:
that copy took 25 us a layer, after two sibling kernels writing dg and du (24 + 16
us), where the three move ~28 us of bytes at the bandwidth.

Written here before partitioning, the products read concatenations: [dg | du] is made by the ops
that made dg and du (in one kernel of ours, see below), and no one reads dg or du alone any more;
dW = x^T [dg | du], cut in two, and dx = [dg | du] [Wg | Wu]^T, one product whose sum runs in its
accumulator and is rounded once, where jax.jit rounds each product and then their sum.

A group is merged only where each concatenation is free: every operand made by an elementwise,
layout or view op (so the kernel making it writes the concatenation instead) and read by nothing
but products merged over that same concatenation. Elsewhere a concatenation would be a copy the
merge need not repay, and the products stay as they are.

XLA does not write such a concatenation from its operands' kernels: at GPT's shapes (H100) it
wrote dg and du and copied them, the MLP block's GPU time 324 us against 311 as written (and
the whole bfloat16 step 13.14 ms against 12.24), where our kernels writing [dg | du] took 286 us
(jax.jit 314). So the cost model counts XLA's copy (plan/cost.py, `xla_copied`) and the region
holding the concatenation is ours. With the weight gradients written in the weights' layout
(transposed_products.py) and the merged forward product's halves read in place (recompute.py),
GPT bfloat16's step (H100) took 11.64 ms of GPU time against 12.19 as written (jax.jit
13.20). On by default (`JAXSTITCH_TUNE=merge_products=0` turns it off).
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
from typing import Callable, Sequence

from jax import lax

from ..core import ir
from ..core.ops import ELEMENTWISE, LAYOUT, VIEWS
from .transposed_products import readers_by_id

MERGED = "matrix products merged"  # the report's name for the products this module removes
_FUSIBLE = ELEMENTWISE | LAYOUT | VIEWS
_SUMS = ("add", "add_any")  # (add_any: how autodiff sums a value's cotangents)


@dataclasses.dataclass(frozen=True)
class _Group:
    """Products merged into one. `shared`: the position (0, 1) of the operand they share, or None for
    products whose results are summed (`root`: the add that sums them, `adds`: every add of that
    sum, root included, `others`: the sum's terms that are not in this group)."""

    dots: tuple[int, ...]          # equation indices, in the order of the concatenations
    shared: int | None
    axes: tuple[int | None, int | None]  # concatenation axis of each operand (None: the shared one)
    root: int | None = None
    adds: tuple[int, ...] = ()
    others: tuple[ir.Atom, ...] = ()


def merge_products(eqns: Sequence, outputs: Sequence[ir.Atom],
                   new_value: Callable[[tuple[int, ...], str], ir.Value]) -> tuple[list, int]:
    """`eqns` (trace.Eqn, in program order) with the mergeable products merged, and how many products
    were removed. `new_value(shape, dtype)` makes a fresh value."""
    eqns = list(eqns)
    users = collections.defaultdict(list)
    for i, e in enumerate(eqns):
        for a in e.inputs:
            if isinstance(a, ir.Value):
                users[a.id].append(i)
    producer = {o.id: i for i, e in enumerate(eqns) for o in e.outputs}
    out_ids = {a.id for a in outputs if isinstance(a, ir.Value)}
    groups = _summed_groups(eqns, users, producer, out_ids)
    taken = {d for g in groups for d in g.dots}
    groups += _shared_groups(eqns, users, taken)
    groups = _free_groups(eqns, groups, users, producer, out_ids)
    if not groups:
        return eqns, 0
    rewritten = _rewrite(eqns, groups, new_value)
    if rewritten is None:  # (a merge would close a cycle: leave the program as it is)
        return eqns, 0
    return rewritten, sum(len(g.dots) - 1 for g in groups)


def _is_product(e) -> bool:
    return (e.primitive.name == "dot_general" and len(e.inputs) == 2
            and all(isinstance(a, ir.Value) and all(isinstance(d, int) for d in a.shape) for a in e.inputs))


def _dims(e):
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    return tuple(map(int, lc)), tuple(map(int, rc)), tuple(map(int, lb)), tuple(map(int, rb))


def _free_axes(e, side: int) -> tuple[int, ...]:
    lc, rc, lb, rb = _dims(e)
    used = set(lc + lb) if side == 0 else set(rc + rb)
    return tuple(d for d in range(len(e.inputs[side].shape)) if d not in used)


def _alike(a, b, skip: int | None = None) -> bool:
    """Same params and operand types (the operand at `skip` aside: the shared one)."""
    return a.params == b.params and all(k == skip or (x.shape, x.dtype) == (y.shape, y.dtype)
                                        for k, (x, y) in enumerate(zip(a.inputs, b.inputs)))


def _summed_groups(eqns, users, producer, out_ids) -> list[_Group]:
    """Products of the same type whose results are only summed (a tree of adds), concatenated along
    their first contracted axis."""
    def absorbed(i):  # an add whose one reader is another add of the same sum
        (o,) = eqns[i].outputs
        return o.id not in out_ids and len(users[o.id]) == 1 and eqns[users[o.id][0]].primitive.name in _SUMS

    groups = []
    for root, e in enumerate(eqns):
        if e.primitive.name not in _SUMS or absorbed(root):
            continue
        adds, leaves, stack = [], [], [root]
        while stack:
            i = stack.pop()
            adds.append(i)
            for a in eqns[i].inputs:
                p = producer.get(a.id) if isinstance(a, ir.Value) else None
                if p is not None and eqns[p].primitive.name in _SUMS and absorbed(p):
                    stack.append(p)
                else:
                    leaves.append(a)
        dots = [producer[a.id] for a in leaves if isinstance(a, ir.Value) and a.id in producer
                and _is_product(eqns[producer[a.id]]) and a.id not in out_ids and len(users[a.id]) == 1]
        dots = sorted(set(dots))
        while dots:
            first, rest = dots[0], dots[1:]
            same = [first] + [d for d in rest if _alike(eqns[first], eqns[d])]
            dots = [d for d in dots if d not in same]
            lc, rc, _, _ = _dims(eqns[first])
            if len(same) < 2 or not lc:
                continue
            members = {eqns[d].outputs[0].id for d in same}
            others = tuple(a for a in leaves if not (isinstance(a, ir.Value) and a.id in members))
            groups.append(_Group(tuple(same), None, (lc[0], rc[0]), root, tuple(sorted(adds)), others))
            break  # one group a sum: its other terms stay terms
    return groups


def _shared_groups(eqns, users, taken) -> list[_Group]:
    """Products of the same type reading one value at the same position, concatenated along the
    other operand's first free axis."""
    groups = []
    for vid, readers in users.items():
        for side in (0, 1):
            dots = sorted({i for i in readers if i not in taken and _is_product(eqns[i])
                           and eqns[i].inputs[side].id == vid and eqns[i].inputs[1 - side].id != vid})
            while dots:
                first = dots[0]
                same = [d for d in dots if _alike(eqns[first], eqns[d], skip=side)]
                dots = [d for d in dots if d not in same]
                free = _free_axes(eqns[first], 1 - side)
                if len(same) < 2 or not free or len({eqns[d].inputs[1 - side].id for d in same}) < len(same):
                    continue
                axes = (None, free[0]) if side == 0 else (free[0], None)
                groups.append(_Group(tuple(same), side, axes))
                taken.update(same)
    return groups


def _concats(eqns, g: _Group) -> list[tuple[int, frozenset, int, tuple[int, ...]]]:
    """(side, operand ids, axis, operand ids in the group's order) of each concatenation `g` reads."""
    out = []
    for side, axis in enumerate(g.axes):
        if axis is not None:
            ids = tuple(eqns[d].inputs[side].id for d in g.dots)
            out.append((side, frozenset(ids), axis, ids))
    return out


def _free_groups(eqns, groups, users, producer, out_ids) -> list[_Group]:
    """The groups whose every concatenation is free (see the module's docstring), their members in an
    order that every group reading the same concatenation agrees on."""
    while True:
        readers = collections.defaultdict(set)  # (operand ids, axis) -> the products merged over it
        for g in groups:
            for _, key, axis, _ in _concats(eqns, g):
                readers[(key, axis)].update(g.dots)
        kept = [g for g in groups if all(
            len(key) == len(g.dots) and all(
                vid in producer and eqns[producer[vid]].primitive.name in _FUSIBLE and vid not in out_ids
                and set(users[vid]) <= readers[(key, axis)] for vid in key)
            for _, key, axis, _ in _concats(eqns, g))]
        kept = _ordered(eqns, kept)
        if len(kept) == len(groups):
            return kept
        groups = kept


def _ordered(eqns, groups) -> list[_Group]:
    """The groups, members reordered to agree wherever they read the same concatenation (a sum's
    group fixes the order of both of its concatenations); a group that cannot agree is dropped."""
    order: dict = {}  # (operand ids, axis) -> operand ids in order
    out = []
    for g in sorted(groups, key=lambda g: g.shared is not None):  # sums first
        for side, key, axis, _ in _concats(eqns, g):
            if (key, axis) in order:  # follow the first order already fixed
                dot_of = {eqns[d].inputs[side].id: d for d in g.dots}
                g = dataclasses.replace(g, dots=tuple(dot_of[v] for v in order[(key, axis)]))
                break
        concats = _concats(eqns, g)
        if any(order.get((key, axis), ids) != ids for _, key, axis, ids in concats):
            continue
        order.update(((key, axis), ids) for _, key, axis, ids in concats)
        out.append(g)
    return out


def _rewrite(eqns, groups, new_value) -> list | None:
    """The equations with each group's products (and its sum's adds) replaced by concatenations,
    one product and the slices or adds that give back the values the program reads; None where the
    result has a cycle."""
    removed: set[int] = set()
    added: list[tuple[int, object]] = []  # (position key, equation)
    concat_of: dict = {}

    def concat(g, side):
        ids = tuple(eqns[d].inputs[side].id for d in g.dots)
        key = (ids, g.axes[side])
        if key not in concat_of:
            parts = [eqns[d].inputs[side] for d in g.dots]
            axis = g.axes[side]
            shape = list(parts[0].shape)
            shape[axis] = sum(p.shape[axis] for p in parts)
            v = new_value(tuple(shape), parts[0].dtype)
            cat = _eqn(eqns[g.dots[0]], lax.concatenate_p, {"dimension": axis}, parts, (v,),
                       for_products=True)
            added.append((min(g.dots), cat))
            concat_of[key] = v
        return concat_of[key]

    for g in groups:
        first = eqns[g.dots[0]]
        removed.update(g.dots)
        ins = [first.inputs[s] if g.axes[s] is None else concat(g, s) for s in (0, 1)]
        out = first.outputs[0]
        if g.shared is None:  # a sum: the product stands for the grouped terms
            removed.update(g.adds)
            terms = g.others
            final = eqns[g.root].outputs[0]
            v = final if not terms else new_value(out.shape, out.dtype)
            added.append((g.root, _eqn(first, first.primitive, first.params, ins, (v,))))
            add = eqns[g.root]
            for k, t in enumerate(terms):
                nxt = final if k == len(terms) - 1 else new_value(out.shape, out.dtype)
                added.append((g.root, _eqn(add, add.primitive, add.params, (v, t), (nxt,))))
                v = nxt
            continue
        side = 1 - g.shared
        _, _, lb, _ = _dims(first)
        free = _free_axes(first, side)
        at = len(lb) + (0 if side == 0 else len(_free_axes(first, 0))) + free.index(g.axes[side])
        shape = list(out.shape)
        shape[at] = sum(eqns[d].outputs[0].shape[at] for d in g.dots)
        merged = new_value(tuple(shape), out.dtype)
        added.append((max(g.dots), _eqn(first, first.primitive, first.params, ins, (merged,))))
        start = 0
        for d in g.dots:
            o = eqns[d].outputs[0]
            lo, hi = [0] * len(shape), list(shape)
            lo[at], hi[at] = start, start + o.shape[at]
            start += o.shape[at]
            cut = {"start_indices": tuple(lo), "limit_indices": tuple(hi), "strides": None}
            added.append((max(g.dots), _eqn(first, lax.slice_p, cut, (merged,), (o,))))
    kept = [(i, e) for i, e in enumerate(eqns) if i not in removed]
    return _topological(kept + added)


def _eqn(like, primitive, params, inputs, outputs, for_products: bool = False):
    """An equation like `like` (trace.Eqn) of `primitive` (`for_products`: a concatenation made for
    the merged products, Eqn.for_products)."""
    return dataclasses.replace(like, primitive=primitive, params=dict(params), inputs=tuple(inputs),
                               outputs=tuple(outputs), effectful=False, for_products=for_products)


def _topological(keyed: list[tuple[int, object]]) -> list | None:
    """The equations in an order where each follows what it reads, nearest their keys (Kahn's
    algorithm over a heap of (key, arrival)); None where some never become ready (a cycle)."""
    made_by = {o.id: n for n, (_, e) in enumerate(keyed) for o in e.outputs}
    waiting = [0] * len(keyed)
    readers = collections.defaultdict(list)
    for n, (_, e) in enumerate(keyed):
        deps = {made_by[a.id] for a in e.inputs if isinstance(a, ir.Value) and a.id in made_by}
        waiting[n] = len(deps)
        for d in deps:
            readers[d].append(n)
    ready = [(k, n) for n, (k, _) in enumerate(keyed) if waiting[n] == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, n = heapq.heappop(ready)
        out.append(keyed[n][1])
        for r in readers[n]:
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, (keyed[r][0], r))
    return out if len(out) == len(keyed) else None


def mark_product_concatenations(eqns: Sequence, outputs: Sequence[ir.Atom]) -> tuple[list, int]:
    """`eqns` with every concatenation that only products read (directly or through reshapes)
    marked `for_products` like the ones merge_products writes, and how many were marked. XLA copies
    those too: GPT's rotary backward concatenates dq, dk and dv for the q/k/v projection's products,
    and XLA wrote the concatenation in the layout of the products making dq, dk and dv, then
    transposed it for the weight gradient's (`input_concatenate_fusion` and `wrapped_transpose`, 12
    each a step, in jax.jit's program as well; H100). Off by default
    (`JAXSTITCH_TUNE=product_concats=1`): that region's kernel, the one it would make ours, needs 168
    registers a thread with the GPU machines' NVRTC and is declined there; built anyway (the cap
    lifted at 4 rows a warp), GPT bfloat16's step was slower, 11.63 -> 11.86 ms busy."""
    users = readers_by_id(eqns)
    out_ids = {a.id for a in outputs if isinstance(a, ir.Value)}

    def only_products(v) -> bool:
        if v.id in out_ids or not users[v.id]:
            return False
        return all(_is_product(u) or (u.primitive.name == "reshape" and only_products(u.outputs[0]))
                   for u in users[v.id])

    marked = [i for i, e in enumerate(eqns) if e.primitive.name == "concatenate" and not e.for_products
              and only_products(e.outputs[0])]
    out = list(eqns)
    for i in marked:
        out[i] = dataclasses.replace(out[i], for_products=True)
    return out, len(marked)
