"""Partition a graph into maximal memory-bound regions, never creating a cycle.

A region is a set of stitchable ops grown greedily in program order; each region becomes one kernel,
so the graph of regions and left-over ops must stay acyclic. An op joins the region of one of its
producers unless that region also reaches the op through some other node (the region would then have
to run both before and after that node). Afterwards, regions that read a common input and do not
depend on each other are merged (sibling fusion), when the caller's `fits` says the union is still one
kernel. Values reduced over the whole grid (column or full reductions) are final only at the kernel's
end, so inside their region they may feed only other such epilogue ops.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from ..core import ir
from ..core import ops as opdefs


@dataclasses.dataclass(frozen=True)
class Region:
    id: int
    ops: tuple[ir.Op, ...]
    inputs: tuple[ir.Value, ...]
    outputs: tuple[ir.Value, ...]
    # Cut from a neighbour that could not also be planned as one kernel: XLA would fuse across the
    # cut, which a stitched piece prevents (the planner leaves such regions to XLA).
    cut: bool = False
    # Indices of ops recomputed here that also stay outside for their other consumers (recompute.py).
    recomputed: frozenset[int] = frozenset()
    # Indices of this region's ops that another kernel (ours or XLA's) computes too: their
    # half-precision results are rounded here as XLA rounds them, so the copies agree (recompute.py).
    shared: frozenset[int] = frozenset()


@dataclasses.dataclass(frozen=True)
class Cuts:
    """Kernel boundaries forced for ablations (JAXSTITCH_TUNE's stitch=0 and grid=0)."""

    at_reduced: bool = False  # an op using a reduced value starts a region (XLA's fusion boundaries)
    at_grid: bool = False     # column and whole-array reductions start regions of their own


@dataclasses.dataclass(frozen=True)
class Partition:
    regions: tuple[Region, ...]
    unsupported: tuple[tuple[int, str], ...]  # (op index, reason) for ops left to XLA


class Nodes:
    """The condensed graph: regions (union-find roots) and single left-over ops, with their deps
    and, the other way, their users (for searching from both ends, see reaches). Each root has a
    level above all of its dependencies' (kept so through `depend` and `union`): a node can only
    depend on nodes of lower levels, which bounds `reaches`' searches (BERT bfloat16's train step:
    its ~18,000 searches visit 131 k nodes, 1.4 M without the bound)."""

    def __init__(self):
        self.parent: dict = {}
        self.deps: dict = {}
        self.users: dict = {}
        self.level: dict = {}
        self.added = 0  # nodes ever added: no level on a path exceeds it
        self.ordered = True  # the levels hold (False once a cycle showed)

    def add(self, node):
        self.added += 1
        self.parent[node] = node
        self.deps[node] = set()
        self.users[node] = set()
        self.level[node] = 0

    def depend(self, node, producers) -> None:
        """Record that `node` reads what `producers` make."""
        self.deps[node] |= set(producers)
        above = -1
        for p in producers:
            p = self.find(p)
            if p != node:
                self.users[p].add(node)
                above = max(above, self.level[p])
        self._lift(node, above + 1)

    def find(self, x):
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a, b):
        a, b = self.find(a), self.find(b)
        if a != b:
            self.parent[b] = a
            self.deps[a] = {self.find(d) for d in self.deps[a] | self.deps.pop(b)} - {a}
            self.users[a] = {self.find(u) for u in self.users[a] | self.users.pop(b)} - {a}
            self.level[a] = max(self.level[a], self.level.pop(b))
            for u in self.users[a]:
                self._lift(u, self.level[a] + 1)
        return a

    def _lift(self, node, level: int) -> None:
        """Raise `node`'s level to at least `level`, and its users' above it, transitively. A
        graph with a cycle has no such levels (remote.groups' graph, where a region's op and an op
        outside it read each other's values through a recomputed op): searches then go unbounded."""
        todo = [(self.find(node), level)]
        while todo and self.ordered:
            n, at_least = todo.pop()
            if self.level[n] >= at_least:
                continue
            self.ordered = at_least <= self.added
            self.level[n] = at_least
            todo.extend((self.find(u), at_least + 1) for u in self.users[n])

    def reaches(self, start_nodes, target) -> bool:
        """Is `target` among the (transitive) dependencies of any of `start_nodes`, themselves
        included? Searched from both ends, a node a side in turn, until the sides meet or one runs
        out: about twice the smaller side's cost. An op's producers late in a program have most of
        it above them; the region it may join has few readers yet. Only nodes between the two
        ends' levels can be on a path."""
        target = self.find(target)
        up = {self.find(s) for s in start_nodes}
        if target in up:
            return True
        if not self.ordered:
            low, high = -1, float("inf")
        else:
            low, high = self.level[target], max((self.level[s] for s in up), default=-1)
        up_todo = [s for s in up if self.level[s] > low]
        down, down_todo = {target}, [target]
        while up_todo and down_todo:
            if self._step(self.deps, up_todo, up, down, lambda n: self.level[n] > low) or \
                    self._step(self.users, down_todo, down, up, lambda n: self.level[n] < high):
                return True
        return False

    def _step(self, edges: dict, todo: list, seen: set, other: set, between) -> bool:
        """Visit the next node of one side of `reaches`' search along `edges`, going on only through
        nodes `between` the ends' levels; whether it met the other side."""
        for n in edges[todo.pop()]:
            n = self.find(n)
            if n in other:
                return True
            if n not in seen and between(n):
                seen.add(n)
                todo.append(n)
        return False

    def can_merge_all(self, members) -> bool:
        """Whether merging all of `members` is safe: no path leaves them and comes back. Only nodes
        above the lowest member's level can lead back to one (a node's level is above its
        dependencies'), so the search stops below it."""
        inside = {self.find(m) for m in members}
        lowest = min(self.level[m] for m in inside) if self.ordered else -1
        stack = [self.find(d) for m in inside for d in self.deps[m] if self.find(d) not in inside]
        seen = set()
        while stack:
            n = stack.pop()
            if n in inside:
                return False
            if n not in seen and self.level[n] > lowest:
                seen.add(n)
                stack.extend(self.find(d) for d in self.deps[n])
        return True

    def can_merge(self, a, b) -> bool:
        """Merging is safe unless one reaches the other through a third node."""
        a, b = self.find(a), self.find(b)
        # (a dependency recorded before a union may name either node itself)
        via_b = [d for d in self.deps[b] if self.find(d) not in (a, b)]
        via_a = [d for d in self.deps[a] if self.find(d) not in (a, b)]
        return not self.reaches(via_b, a) and not self.reaches(via_a, b)


def partition(graph: ir.Graph, fits: Callable[[Region], bool] | None = None, cuts: Cuts = Cuts()) -> Partition:
    nodes = Nodes()
    reduced: set[int] = set()  # outputs of reductions, and layout ops of them (for cuts.at_reduced)
    node_of_value: dict[int, object] = {}
    region_ops: dict[int, list[ir.Op]] = {}
    epilogue: set[int] = set()
    shapes: dict[int, set[tuple[int, ...]]] = {}  # per region, the array shapes its ops touch
    consumers = consumers_of(graph)
    cut: list[tuple[frozenset[int], int]] = []  # (a region's ops, an op it refused): see Region.cut
    unsupported = []

    for op in graph.ops:
        vals = [a.id for a in op.inputs if isinstance(a, ir.Value)]
        producers = {nodes.find(node_of_value[v]) for v in vals if v in node_of_value}
        reason = opdefs.unsupported_reason(op)
        if reason is not None:
            unsupported.append((op.index, reason))
            node = ("op", op.index)
            nodes.add(node)
            nodes.depend(node, producers)
            for o in op.outputs:
                node_of_value[o.id] = node
            continue
        candidates, is_epi = _candidate_regions(op, vals, nodes, node_of_value, region_ops, reduced, epilogue, cuts)
        joined = None
        for r in candidates:
            others = [p for p in producers if p != r]
            if nodes.reaches(others, r):
                continue
            if fits is not None and not _still_fits(consumers, region_ops, shapes, r, joined, op, fits):
                if op.prim not in opdefs.VIEWS:  # (a data move no kernel of ours holds: XLA's own too)
                    cut.append((frozenset(o.index for o in region_ops[r]), op.index))
                continue
            if joined is None:
                joined = r
            elif nodes.can_merge(joined, r):
                ops_a, ops_b = region_ops.pop(joined), region_ops.pop(r)
                shapes_ab = shapes.pop(joined, set()) | shapes.pop(r, set())
                joined = nodes.union(joined, r)
                region_ops[joined] = ops_a + ops_b
                shapes[joined] = shapes_ab
        if joined is None:
            joined = op.index
            nodes.add(joined)
            region_ops[joined] = []
        region_ops[joined].append(op)
        shapes.setdefault(joined, set()).update(_shapes(op))
        nodes.depend(joined, {p for p in producers if p != joined})
        for o in op.outputs:
            node_of_value[o.id] = joined
            if is_epi:
                epilogue.add(o.id)
            if (set(vals) & reduced) if opdefs.is_layout(op) else op.prim in opdefs.REDUCTIONS:
                reduced.add(o.id)

    if fits is not None and not cuts.at_reduced:
        if cuts.at_grid:  # column reductions merge with each other, not with row work
            fits = _grid_apart(fits)
        _merge_siblings(consumers, nodes, region_ops, fits)
        _merge_across_views(consumers, nodes, region_ops, fits)
        _tables_apart(region_ops)
    return Partition(_collect(consumers, region_ops, cut), tuple(unsupported))


def _candidate_regions(op: ir.Op, vals: list[int], nodes: Nodes, node_of_value: dict, region_ops: dict,
                       reduced: set[int], epilogue: set[int], cuts: Cuts) -> tuple[list, bool]:
    """The regions `op` may join (its producers', less those the cuts and epilogue rules exclude), in
    order of its operands, and whether `op` is an epilogue op (its results final only at the kernel's end)."""
    candidates = [nodes.find(node_of_value[v]) for v in vals
                  if v in node_of_value and nodes.find(node_of_value[v]) in region_ops]
    candidates = list(dict.fromkeys(candidates))
    if any(o.size > 1 for o in op.outputs):
        candidates = [r for r in candidates if not _through_scalars(op, r, region_ops[r], nodes, node_of_value)]
    if cuts.at_reduced and not opdefs.is_layout(op):
        candidates = [r for r in candidates
                      if not any(v in reduced and nodes.find(node_of_value[v]) == r for v in vals)]
    if cuts.at_grid and opdefs.is_grid_reduction(op):
        candidates = []
    epi_in = [v for v in vals if v in epilogue]
    is_epi = opdefs.is_grid_reduction(op)
    if epi_in:
        home = nodes.find(node_of_value[epi_in[0]])
        pure = (op.prim in opdefs.ELEMENTWISE or opdefs.is_layout(op)) and len(epi_in) == len(vals) \
            and all(nodes.find(node_of_value[v]) == home for v in vals)
        # Not pure: the op may not join the epilogue's region, but it may join another producer's
        # (an optimizer's update reads a stitched bias gradient and `b1 * mu` beside it).
        epi_homes = {nodes.find(node_of_value[v]) for v in epi_in}
        candidates, is_epi = ([home], True) if pure else ([r for r in candidates if r not in epi_homes], False)
    return candidates, is_epi


# A table computed from small values alone, this many times smaller than its region's largest value,
# is split out of the region (it becomes a small region of its own, XLA's, and the region reads it
# through a broadcasting view): inside, every thread would evaluate its expensive ops again at each
# element the table is broadcast to (recompute.py does not take it back in). GPT's rotary embedding
# alone ([8, 512, 12, 64] float32, H200): ours with the [512, 32] tables' pow, cos and
# sin inside took 34.0 us, jax.jit 19.8; its backward concatenated over q, k and v, built so (H100:
# 6676 PTX instructions, precise sinf, cosf and powf at each element of dq's and dk's
# chains), made GPT's step 0.23 ms slower. Plans that stitch no such region are unchanged (BERT,
# GPT, DIEN and the suite: the same kernels).
TABLE_RATIO = 64


def _tables_apart(region_ops: dict) -> None:
    """Split each region's small tables out into regions of their own: the ops computing an
    expensive value (opdefs.EXPENSIVE) of two or more real axes, TABLE_RATIO times smaller than the
    region's largest, from small values alone, and what they compute it from. (Row and column
    vectors stay: a kernel evaluates those once a row or a column.)"""
    for key in list(region_ops):
        rops = region_ops[key]
        big = max((o.size for op in rops for o in op.outputs), default=0)
        made_by = {o.id: op for op in rops for o in op.outputs}
        small: set[int] = set()  # ops whose values, and every in-region value they read, are small
        for op in rops:
            inner = [made_by[a.id].index for a in op.inputs if isinstance(a, ir.Value) and a.id in made_by]
            if all(o.size * TABLE_RATIO <= big for o in op.outputs) and all(i in small for i in inner):
                small.add(op.index)
        table = {op.index for op in rops if op.index in small and op.prim in opdefs.EXPENSIVE
                 and any(sum(d > 1 for d in o.shape) >= 2 for o in op.outputs)}
        for op in reversed(rops):  # (and what they are computed from)
            if op.index in table:
                table.update(made_by[a.id].index for a in op.inputs if isinstance(a, ir.Value) and a.id in made_by)
        if table and len(table) < len(rops):
            region_ops[key] = [op for op in rops if op.index not in table]
            region_ops[("table", key)] = [op for op in rops if op.index in table]


def structure(region: Region) -> tuple:
    """The region up to the names of its values: every op's primitive, parameters and operands,
    every value's shape and dtype, literals by their repr (so -0.0 is not 0.0), with value ids
    numbered by first appearance. A model's repeated layers give equal keys, and whether a region
    plans as one kernel depends on nothing else. May hold an unhashable parameter (TypeError when
    hashed)."""
    ids: dict[int, int] = {}

    def ref(a):
        if isinstance(a, ir.Value):
            return ids.setdefault(a.id, len(ids)), a.shape, a.dtype
        return type(a.value).__name__, repr(a.value), a.dtype

    inputs = tuple(ref(v) for v in region.inputs)
    ops = tuple((op.prim, op.params, tuple(ref(a) for a in op.inputs), tuple(ref(o) for o in op.outputs))
                for op in region.ops)
    recomputed = tuple(i for i, op in enumerate(region.ops) if op.index in region.recomputed)
    return inputs, ops, tuple(ref(v) for v in region.outputs), region.cut, recomputed


def resized(part: Partition, graph: ir.Graph) -> Partition:
    """`part` over `graph`: the same program at other sizes (the same op indices and value ids,
    trace.at_sizes), each region's ops and values looked up there."""
    values = ir.values_by_id(graph)

    def region(r: Region) -> Region:
        return dataclasses.replace(r, ops=tuple(graph.ops[op.index] for op in r.ops),
                                   inputs=tuple(values[v.id] for v in r.inputs),
                                   outputs=tuple(values[v.id] for v in r.outputs))
    return dataclasses.replace(part, regions=tuple(region(r) for r in part.regions))


def _grid_apart(fits):
    def fits_apart(region: Region) -> bool:
        grid = [opdefs.is_grid_reduction(op) for op in region.ops if op.prim in opdefs.REDUCTIONS]
        return (all(grid) or not any(grid)) and fits(region)
    return fits_apart


def _through_scalars(op: ir.Op, r, rops: list[ir.Op], nodes: Nodes, node_of_value: dict) -> bool:
    """Whether the array op `op` would join region `r` only through scalars `r` computes from its
    inputs or next to arrays. Such an op starts a region of its own: chains that share only a scalar
    (every parameter's update reads an optimizer's bias corrections) are independent kernels, which
    remote stitching (plan/remote.py) launches together; joined, they would pile into one region of
    unrelated shapes. A scalar made of constants alone (a loss's 1/n) is still joined."""
    if not all(a.size <= 1 for a in op.inputs
               if isinstance(a, ir.Value) and a.id in node_of_value and nodes.find(node_of_value[a.id]) == r):
        return False
    made = {v.id for o in rops for v in o.outputs}
    reads = any(isinstance(a, ir.Value) and a.id not in made for o in rops for a in o.inputs)
    return reads or any(v.size > 1 for o in rops for v in o.outputs)


def _shapes(op: ir.Op) -> set[tuple[int, ...]]:
    return {tuple(v.shape) for v in (*op.inputs, *op.outputs) if isinstance(v, ir.Value) and v.shape}


def _still_fits(consumers, region_ops, shapes, r, joined, op, fits) -> bool:
    """Whether region `r` (with `joined`, the region the op already merges) stays one kernel with `op`
    added. A region grows through a shared scalar into chains of other shapes (an optimizer's
    bias corrections reach every parameter's update), or through a reduction into rows of another
    length (attention's scores, then its softmax): such an op starts a region of its own instead,
    so the rest stays stitchable. An elementwise op that brings no shape `r` lacks (nor does
    `joined`) cannot break its placement and skips the check."""
    new = _shapes(op) | (shapes.get(joined, set()) if joined is not None else set())
    if op.prim in opdefs.ELEMENTWISE and new <= shapes.get(r, set()):
        return True
    rops = region_ops[r] + (region_ops[joined] if joined is not None else []) + [op]
    return fits(make_region(-1, sorted(rops, key=lambda o: o.index), consumers))


def _merge_siblings(consumers: dict[int, set[int]], nodes: Nodes, region_ops: dict, fits):
    """Merge regions that read a common input and do not depend on each other (one pass over inputs).
    A common scalar is no reason to merge: reading it twice costs nothing (and an optimizer's step
    count, read by every parameter's update, would pair hundreds of regions)."""
    readers: dict[int, list] = {}
    for root, rops in region_ops.items():
        for op in rops:
            for a in op.inputs:
                if isinstance(a, ir.Value) and a.shape and root not in readers.setdefault(a.id, []):
                    readers[a.id].append(root)
    for vid in sorted(readers):
        group = readers[vid]
        for i in range(len(group)):
            for j in range(i + 1, len(group)):
                a, b = nodes.find(group[i]), nodes.find(group[j])
                if a == b or a not in region_ops or b not in region_ops:
                    continue
                if nodes.reaches([a], b) or nodes.reaches([b], a):
                    continue
                merged = sorted(region_ops[a] + region_ops[b], key=lambda op: op.index)
                if not fits(make_region(-1, merged, consumers)):
                    continue
                del region_ops[a], region_ops[b]
                root = nodes.union(a, b)
                region_ops[root] = merged


def _merge_across_views(consumers: dict[int, set[int]], nodes: Nodes, region_ops: dict, fits):
    """Merge regions linked through a data-moving op. Greedy growth cannot take `x[..., :h]` into the
    region that made x: alone, the slice's result has a shape of its own. Its consumers bring the
    data back to the row space (a rotary embedding's concatenate; a gradient's pad), so the regions
    merge once the chain is whole, in one kernel that reads x again where it is needed
    (plan/views.py). First each group of regions connected through such links (a rotary embedding
    with its norm and its gradient), whole; then, where a group is not one kernel, pairs. Regions
    holding a grid reduction are not merged into their readers (its result exists only at their
    kernel's end). A merged set of ops that did not fit one kernel never will (`fits` looks at the
    ops alone), so each such set is tried once: the pairs are retried after every merge elsewhere,
    as a merge may remove the outside path that kept a pair apart."""
    unfit: set[frozenset[int]] = set()
    # Members (root, ops held) whose merge was refused: a region only grows under its root, so this
    # names its ops; and a refusal stands while they do, as merges elsewhere only coarsen the paths
    # that leave them and come back (GPT: 1,365 path searches refused, most of them repeats).
    refused: set[tuple] = set()
    refuses = getattr(fits, "refuses", None)  # (a quick, sound no from the members' OpsShapes)
    shape_of: dict[tuple, OpsShape] = {}  # by (root, ops held)

    def quickly_refused(members) -> bool:
        if refuses is None:
            return False
        parts = []
        for m in members:
            held = (m, len(region_ops[m]))
            if held not in shape_of:
                shape_of[held] = ops_shape(region_ops[m], consumers)
            parts.append(shape_of[held])
        return refuses(parts)

    def links():
        made_by = {o.id: root for root, rops in region_ops.items() for op in rops for o in op.outputs}
        moving = {root for root, rops in region_ops.items() if any(op.prim in opdefs.VIEWS for op in rops)}
        reducing = {root for root, rops in region_ops.items() if any(opdefs.is_grid_reduction(op) for op in rops)}
        for root in sorted(region_ops):
            sources = {made_by[a.id] for op in region_ops[root] for a in op.inputs
                       if isinstance(a, ir.Value) and a.id in made_by} - {root}
            for src in sorted(sources):
                if (src in moving or root in moving) and src not in reducing:
                    yield src, root

    def merge(members) -> bool:
        held = tuple((m, len(region_ops[m])) for m in members)
        if held in refused:
            return False
        merged = sorted((op for m in members for op in region_ops[m]), key=lambda op: op.index)
        key = frozenset(op.index for op in merged)
        if key in unfit or not nodes.can_merge_all(members):
            refused.add(held)
            return False
        if quickly_refused(members) or not fits(make_region(-1, merged, consumers)):
            unfit.add(key)
            refused.add(held)
            return False
        for m in members:
            del region_ops[m]
        root = members[0]
        for m in members[1:]:
            root = nodes.union(root, m)
        region_ops[root] = merged
        return True

    groups: dict = {r: {r} for r in region_ops}
    for src, root in links():
        union = groups[src] | groups[root]
        for r in union:
            groups[r] = union
    for group in {id(g): g for g in groups.values()}.values():
        if len(group) > 1:
            merge(sorted(group))
    changed = True
    while changed:
        changed = any(merge([src, root]) for src, root in links())


# The program's results count as read by an op no region holds.
PROGRAM_OUTPUT = -1


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpsShape:
    """What a quick refusal of a union of regions needs of each member's ops, known without building
    the union (plan/views.refused_union, asked through `fits.refuses`)."""

    reduces: bool                    # a reduction or a scan
    moves: bool                      # a data-moving op other than a transpose
    results: tuple[int, ...]         # the sizes of the program's results it makes
    shapes: frozenset                # the shapes of the values it reads and makes


def ops_shape(rops: list[ir.Op], consumers: dict[int, set[int]]) -> OpsShape:
    """A member's OpsShape: made once while the member holds the same ops, so a union's refusal costs
    its members' few shapes rather than a pass over its hundreds of ops."""
    values = [a for op in rops for a in (*op.inputs, *op.outputs) if isinstance(a, ir.Value)]
    return OpsShape(reduces=any(op.prim in opdefs.REDUCTIONS or op.prim in opdefs.SCANS for op in rops),
                    moves=any(op.prim in opdefs.VIEWS and op.prim != "transpose" for op in rops),
                    results=tuple(o.size for op in rops for o in op.outputs
                                  if PROGRAM_OUTPUT in consumers.get(o.id, ())),
                    shapes=frozenset(v.shape for v in values))


def consumers_of(graph: ir.Graph) -> dict[int, set[int]]:
    """The ops reading each value, by index (PROGRAM_OUTPUT for the program's results)."""
    out: dict[int, set[int]] = {}
    for op in graph.ops:
        for a in op.inputs:
            if isinstance(a, ir.Value):
                out.setdefault(a.id, set()).add(op.index)
    for a in graph.outputs:
        if isinstance(a, ir.Value):
            out.setdefault(a.id, set()).add(PROGRAM_OUTPUT)
    return out


def make_region(rid: int, rops: list[ir.Op], consumers: dict[int, set[int]],
                 cut: bool = False) -> Region:
    members = {op.index for op in rops}
    produced = {o.id for op in rops for o in op.outputs}
    inputs, seen = [], set()
    for op in rops:
        for a in op.inputs:
            if isinstance(a, ir.Value) and a.id not in produced and a.id not in seen:
                seen.add(a.id)
                inputs.append(a)
    outputs = [o for op in rops for o in op.outputs if not members.issuperset(consumers.get(o.id, ()))]
    return Region(rid, tuple(rops), tuple(inputs), tuple(outputs), cut)


def _collect(consumers: dict[int, set[int]], region_ops: dict,
             cut: list[tuple[frozenset[int], int]]) -> tuple[Region, ...]:
    """The regions in program order; a region is cut where it holds a refusing region's ops or a
    refused op but not both (merged later, they are one kernel after all)."""
    ordered = sorted(region_ops.values(), key=lambda rops: min(op.index for op in rops))

    def is_cut(members: set[int]) -> bool:
        return any((bool(ops & members) or op in members) and not (ops <= members and op in members)
                   for ops, op in cut)
    return tuple(make_region(i, sorted(rops, key=lambda op: op.index), consumers,
                              is_cut({op.index for op in rops}))
                 for i, rops in enumerate(ordered))
