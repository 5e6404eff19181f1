"""Remote stitching: independent elementwise regions launched together as one kernel.

An optimizer's update over a model's parameters is hundreds of chains with no path between them,
each one XLA kernel already: what they cost beyond their bytes is a launch (and a tail of idle SMs)
each. Here such regions are grouped and planned as one kernel whose blocks each take a tile of one
member's elements (a multi-tensor apply). Members with the same op structure share one code body,
their buffers found through a table, so the kernel's size grows with the kinds of chains, not
their count.

Which regions may merge: a "flat" region, whose values all have one element count or are scalars
(its arrays are walked as one flat range, whatever their shapes), that the row planner left to XLA.
Grouping never creates a cycle: a region joins a group only if neither reaches the other in the
region graph with the groups so far already merged.
"""
from __future__ import annotations

import dataclasses
import math

from ..core import ir
from ..core import ops as opdefs
from ..core.targets import Target
from ..graph.partition import Nodes, Region
from . import cost

BLOCK = 256
ELEMS_PER_THREAD = 16         # a task: 16 elements a thread (4 vectors of float32), 4096 a block
# Kernel parameters are one table of buffer pointers, passed by value. CUDA allows 32764 bytes of
# them (Volta and later, CUDA 12.1 and later), but past 4 KB a launch starts late: on an H100 the
# AdamW update over BERT-base (1395 buffers, 11 KB) in one table left the GPU idle 80-153 us
# after XLA's kernels before it, in two tables 68-80 us, in four (at most 4000 bytes each) 3 us;
# the update's span went 1123-1152 -> 1062-1064 us (float32) and 965-972 -> 837-839 (bfloat16),
# and eight tables added launches' tails (1078-1082, 854-857). A group with more buffers is split.
MAX_BUFFERS = 500
# A member's last tile ends element by element, and members much smaller than a tile leave threads
# idle. AdamW over BERT-base measured 97% (float32) / 96% (bfloat16) of the copy bandwidth on an
# H100; 0.85 keeps the estimate on our side for groups of small members.
REMOTE_EFFICIENCY = 0.85


@dataclasses.dataclass(frozen=True)
class Member:
    """One merged region: its elements are tasks [first_task, first_task + tasks) of the grid;
    `buffers` are the kernel's pointer-table indices of its inputs, then its outputs."""

    region: Region
    size: int
    first_task: int
    tasks: int
    body: int           # which code body (index into RemotePlan.bodies)
    slot: int           # its row in that body's buffer table
    buffers: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class RemoteMapping:
    grid: int
    block: int
    vec: int
    tile: int           # elements per task (one block)
    members: int
    smem_bytes: int = 0
    cooperative: bool = False
    min_blocks: int = 1
    n_rows: int | None = None
    n_cols: int | None = None

    @property
    def name(self) -> str:
        return f"{self.members} independent chains, a block per {self.tile}-element tile"


@dataclasses.dataclass(frozen=True)
class RemotePlan:
    region: Region                  # the union of the members (inputs and outputs in buffer order)
    members: tuple[Member, ...]
    bodies: tuple[Region, ...]      # one representative member per op structure
    mapping: RemoteMapping
    workspace_bytes: int = 0
    # (input, output) positions in `region` whose buffers are one: outputs written in place
    aliases: tuple[tuple[int, int], ...] = ()

    @property
    def scheme(self) -> str:
        return "remote"

    @property
    def description(self) -> str:
        return f"{self.mapping.name}, {len(self.bodies)} code bodies"


def flat_size(region: Region) -> int | None:
    """The element count of a flat region (every value that count or a scalar, only elementwise and
    layout ops), else None."""
    sizes = {v.size for op in region.ops for v in (*op.inputs, *op.outputs) if isinstance(v, ir.Value)}
    arrays = sizes - {1}
    if len(arrays) != 1 or not region.outputs:
        return None
    if any(op.prim not in opdefs.ELEMENTWISE and not opdefs.is_layout(op) for op in region.ops):
        return None
    return arrays.pop()


def structure(region: Region) -> tuple:
    """The region's ops with values renamed in order of appearance and shapes dropped (a flat region's
    code depends only on this): equal structures share one code body."""
    names: dict[int, int] = {}

    def name(a):
        if isinstance(a, ir.Const):
            return ("const", a.value, a.dtype)
        if a.id not in names:
            names[a.id] = len(names)
        return (names[a.id], a.dtype, a.size == 1)

    inputs = tuple(name(v) for v in region.inputs)
    body = tuple((op.prim, () if opdefs.is_layout(op) else op.params,
                  tuple(name(a) for a in op.inputs), tuple(name(o) for o in op.outputs))
                 for op in region.ops)
    return inputs, body, tuple(name(v) for v in region.outputs)


def _region_graph(graph: ir.Graph, regions: tuple[Region, ...]) -> Nodes:
    """Regions and the ops outside them as nodes, with their dependencies."""
    node = {op.index: ("r", r.id) for r in regions for op in r.ops}
    nodes, producer = Nodes(), {}
    for op in graph.ops:
        n = node.get(op.index, ("e", op.index))
        if n not in nodes.parent:
            nodes.add(n)
        nodes.depend(n, {producer[a.id] for a in op.inputs
                         if isinstance(a, ir.Value) and a.id in producer and producer[a.id] != n})
        for o in op.outputs:
            producer[o.id] = n
    return nodes


def groups(graph: ir.Graph, regions: tuple[Region, ...], candidates: list[Region]) -> list[list[Region]]:
    """Candidates in program order, each joining the first group it has no path to or from (in the
    graph with the groups so far merged, so no group reaches another both ways: no cycle), within
    the parameter table's size."""
    nodes = _region_graph(graph, regions)
    out: list[tuple[object, list[Region], int]] = []  # (node, members, buffers)
    for r in candidates:
        n, size = ("r", r.id), len(r.inputs) + len(r.outputs)
        for i, (g, members, count) in enumerate(out):
            g = nodes.find(g)
            if count + size <= MAX_BUFFERS and not nodes.reaches([n], g) and not nodes.reaches([g], n):
                out[i] = (nodes.union(g, n), members + [r], count + size)
                break
        else:
            out.append((n, [r], size))
    return [members for _, members, _ in out if len(members) > 1]


def plan_remote(members: list[Region], rid: int, target: Target, spent: frozenset[int] = frozenset(),
                favoured: frozenset[int] = frozenset()) -> tuple[RemotePlan, cost.Estimate]:
    """One kernel for `members` (independent flat regions), and its cost against XLA's kernel each.
    `spent` and `favoured`: which outputs are written over which inputs (in_place)."""
    inputs: dict[int, ir.Value] = {}
    outputs: list[ir.Value] = []
    for r in members:
        for v in r.inputs:
            inputs.setdefault(v.id, v)
        outputs += r.outputs
    position = {v: i for i, v in enumerate(inputs)}
    position.update({v.id: len(inputs) + j for j, v in enumerate(outputs)})
    ops = tuple(sorted((op for r in members for op in r.ops), key=lambda op: op.index))
    region = Region(rid, ops, tuple(inputs.values()), tuple(outputs),
                    recomputed=frozenset().union(*(r.recomputed for r in members)),
                    shared=frozenset().union(*(r.shared for r in members)))

    itemsize = max(v.itemsize for r in members for v in (*r.inputs, *r.outputs) if v.size > 1)
    vec = max(1, 16 // itemsize)
    tile = BLOCK * max(vec, ELEMS_PER_THREAD)
    bodies: dict[tuple, int] = {}
    reps: list[Region] = []
    slots: dict[int, int] = {}
    planned, task = [], 0
    for r in members:
        key = structure(r)
        if key not in bodies:
            bodies[key] = len(reps)
            reps.append(r)
        b = bodies[key]
        size = flat_size(r)
        tasks = -(-size // tile)
        buffers = tuple(position[v.id] for v in (*r.inputs, *r.outputs))
        planned.append(Member(r, size, task, tasks, b, slots.get(b, 0), buffers))
        slots[b] = slots.get(b, 0) + 1
        task += tasks
    mapping = RemoteMapping(task, BLOCK, vec, tile, len(members))
    aliases = tuple((position[i.id], position[o.id] - len(inputs))
                    for r in members for i, o in in_place(r, spent, favoured))
    return RemotePlan(region, tuple(planned), tuple(reps), mapping, aliases=aliases), estimate(members, target)


def in_place(r: Region, spent: frozenset[int], favoured: frozenset[int] = frozenset()) -> list[tuple[ir.Value, ir.Value]]:
    """(input, output) pairs of a flat region whose output may overwrite its input: the input is
    `spent` (read by nothing else, not a program output), of the output's shape and type, and the
    output is computed from it. Then each element is loaded before the thread that loads it stores
    the element over it, and an optimizer's update writes the state it read (with the state donated,
    XLA then copies nothing: one copy per buffer otherwise, a launch each).
    Outputs with fewer candidates choose first, each a `favoured` input first (program inputs:
    donated buffers are those), then the one fewest ops away. Adam: m over m, v over v, p over p."""
    producer = {o.id: op for op in r.ops for o in op.outputs}

    def depths(v: ir.Value) -> dict[int, int]:
        """Values `v` is computed from, with the fewest ops between (breadth first)."""
        out, frontier, d = {v.id: 0}, [v], 0
        while frontier:
            d += 1
            nxt = []
            for x in frontier:
                op = producer.get(x.id)
                for a in (op.inputs if op is not None else ()):
                    if isinstance(a, ir.Value) and a.id not in out:
                        out[a.id] = d
                        nxt.append(a)
            frontier = nxt
        return out

    options = {}
    for o in r.outputs:
        depth = depths(o)
        options[o.id] = sorted((i for i in r.inputs if i.id in spent and i.id in depth and i.shape == o.shape
                                and i.dtype == o.dtype), key=lambda i: (i.id not in favoured, depth[i.id]))
    taken, pairs = set(), []
    for o in sorted(r.outputs, key=lambda o: len(options[o.id])):
        free = [i for i in options[o.id] if i.id not in taken]
        if free:
            taken.add(free[0].id)
            pairs.append((free[0], o))
    return pairs


def estimate(members: list[Region], target: Target) -> cost.Estimate:
    """Our one launch over every member's bytes, against one XLA kernel per member (each at a row
    kernel's efficiency, its grid on as many SMs as its size fills)."""
    bw = target.bandwidth_gbs * 1e3
    total = sum(v.nbytes for r in members for v in (*r.inputs, *r.outputs))
    ours = total / (bw * REMOTE_EFFICIENCY) + target.launch_us
    xla = 0.0
    for r in members:
        nbytes = sum(v.nbytes for v in (*r.inputs, *r.outputs))
        blocks = math.ceil(flat_size(r) / (BLOCK * 4))
        share = min(1.0, cost.SM_OVERDRIVE * blocks / target.sm_count)
        xla += nbytes / (bw * cost.OUR_EFFICIENCY * share) + target.launch_us
    return cost.Estimate(total, ours, len(members), total, xla)
