"""A column or whole-array reduction's tail, moved into the region that reads it.

The partitioner keeps a grid reduction's epilogue (elementwise work on its result, such as Adam's
`0.1 g` and `0.001 g^2` on a bias gradient) in the reduction's region, which then writes the
tail's results for the region that reads them (the optimizer's update). Moved into that reader,
the reduction writes its result alone and the reader computes the tail at each element it reads
anyway: one value written and read instead of two here, and, when XLA's partitioner splits the
reduced rows over several devices, the region planned per shard ends with the reduction and its
all-reduce, not with the tail after it, which XLA could not fuse into our reader and ran as a
kernel of its own (2 H200s, a data-parallel BERT step: 126 more memory-bound kernels than on one).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from ..core import ir
from ..core import ops as opdefs
from .partition import PROGRAM_OUTPUT, Partition, Region, consumers_of, make_region


def move_tails(graph: ir.Graph, part: Partition, fits: Callable[[Region], bool]) -> Partition:
    """`part` with each grid reduction's tail that one other region alone reads moved into that
    region, where the region still `fits` as one kernel."""
    consumers = consumers_of(graph)
    region_of = {op.index: r.id for r in part.regions for op in r.ops}
    ops_of = {r.id: list(r.ops) for r in part.regions}
    moves: dict[int, list[tuple[int, list[ir.Op]]]] = {}  # home -> (tail's region, tail), in order
    for r in part.regions:
        for tail in _tails(r):
            home = _sole_reader(tail, consumers, region_of)
            if home is not None and home != r.id:
                moves.setdefault(home, []).append((r.id, tail))
    for home, tails in moves.items():
        # All of a home's tails at once, one fits check (an optimizer's update region takes a tail
        # from each bias gradient: GPT's step asked 25 checks of ~940 ops, 0.4 s); else one by one.
        if not _move(home, tails, ops_of, region_of, consumers, fits) and len(tails) > 1:
            for t in tails:
                _move(home, [t], ops_of, region_of, consumers, fits)
    if all(len(ops_of[r.id]) == len(r.ops) for r in part.regions):
        return part
    ordered = sorted(part.regions, key=lambda r: min(op.index for op in ops_of[r.id]))
    regions = tuple(dataclasses.replace(make_region(i, ops_of[r.id], consumers), cut=r.cut)
                    for i, r in enumerate(ordered))
    return dataclasses.replace(part, regions=regions)


def _move(home: int, tails: list[tuple[int, list[ir.Op]]], ops_of: dict, region_of: dict,
          consumers: dict, fits: Callable[[Region], bool]) -> bool:
    """Moves the tails into region `home` where it then still fits; whether it did."""
    grown = sorted(ops_of[home] + [op for _, tail in tails for op in tail], key=lambda op: op.index)
    if not fits(make_region(home, grown, consumers)):
        return False
    for rid, tail in tails:
        moved = {op.index for op in tail}
        ops_of[rid] = [op for op in ops_of[rid] if op.index not in moved]
        region_of.update((i, home) for i in moved)
    ops_of[home] = grown
    return True


def _tails(r: Region) -> list[list[ir.Op]]:
    """The region's tail ops, in groups joined by their values: elementwise or layout ops that read
    only the results of the region's grid reductions and of other tail ops (and constants)."""
    final = {o.id for op in r.ops if opdefs.is_grid_reduction(op) for o in op.outputs}
    if not final:
        return []
    tails: list[list[ir.Op]] = []
    group_of: dict[int, int] = {}  # value id -> index into tails, for tail ops' results
    for op in r.ops:
        vals = [a.id for a in op.inputs if isinstance(a, ir.Value)]
        pure = (op.prim in opdefs.ELEMENTWISE or opdefs.is_layout(op)) and vals and all(v in final for v in vals)
        if not pure:
            continue
        groups = sorted({group_of[v] for v in vals if v in group_of})
        if not groups:
            tails.append([])
            groups = [len(tails) - 1]
        into = groups[0]
        for g in groups[1:]:  # (an op joining two groups: one group)
            tails[into] += tails[g]
            tails[g] = []
            group_of.update((o.id, into) for t in tails[into] for o in t.outputs)
        tails[into].append(op)
        for o in op.outputs:
            final.add(o.id)
            group_of[o.id] = into
    return [sorted(t, key=lambda op: op.index) for t in tails if t]


def _sole_reader(tail: list[ir.Op], consumers: dict[int, set[int]], region_of: dict[int, int]) -> int | None:
    """The one region reading the tail's results, or None: read by the program's results, by an op
    no region holds, by two regions, or by the tail's own region."""
    members = {op.index for op in tail}
    readers = {c for op in tail for o in op.outputs for c in consumers.get(o.id, ()) if c not in members}
    if not readers or PROGRAM_OUTPUT in readers or any(c not in region_of for c in readers):
        return None
    homes = {region_of[c] for c in readers}
    return homes.pop() if len(homes) == 1 else None
