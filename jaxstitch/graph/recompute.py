"""Recompute cheap producers inside a region instead of reading what they wrote.

A region's input made by a short elementwise chain outside it (a convert to float32, `x - mean`,
`x * rsqrt(var)`) is something XLA never writes on its own: it fuses the chain into every consumer,
recomputing it there. Read from memory by our kernel, the chain's result must be written first, so a
stitched backward pass can cost the forward pass an extra kernel and both of them the bytes of a
full float32 array. Here each region takes in such chains wherever that moves fewer bytes (the
chain's leaves instead of its result). The chain's ops stay outside too, for their other consumers;
XLA drops them where none is left, and a stitched producer stops writing a result no one reads
(_drop_unread).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable

from ..core import ir
from ..core import ops as opdefs
from . import pinned_values, positions, wide_converts
from .partition import TABLE_RATIO, Partition, Region

MAX_CHAIN_OPS = 8      # ops recomputed for one input
MAX_BYTES_RATIO = 0.75  # the leaves' new bytes against the input's, at most
# A chain that rounds a float to bfloat16 which the region computes with unrounded
# (wide_converts.py) is taken in for consistency even where its leaves cost more bytes, up to this
# share of the region's largest value: see _unrounds.
MAX_UNROUNDED_SHARE = 1 / 16


def recompute_cheap_inputs(graph: ir.Graph, part: Partition, fits: Callable[[Region], bool],
                           unread_writes: bool = True, leaf_chains: bool = True) -> Partition:
    """`unread_writes`: count, against a chain's leaves, the write of an input its region alone reads
    (its producer no longer writes it once the chain is taken in), not only its read, and take in
    chains that share a leaf together (_adopt_shared_leaves). `leaf_chains`: also trade a leaf no
    kernel writes for the written value its own chain starts from (_adopt_chains), and count values
    computed from positions alone among those a dropped write is rebuilt from (_drop_unread)."""
    pinned = pinned_values.pinned(graph)  # (read as written, never recomputed: as if made by no op)
    producer = {o.id: op for op in graph.ops for o in op.outputs if o.id not in pinned}
    hidden = {o for r in part.regions for op in r.ops for o in op.outputs} - \
        {o for r in part.regions for o in r.outputs}
    sole = _read_once(graph, part) if unread_writes else set()
    regions = tuple(_adopt_chains(r, producer, hidden, sole, fits, leaf_chains) for r in part.regions)
    if unread_writes:
        regions = tuple(_adopt_shared_leaves(r, producer, hidden, sole, fits) for r in regions)
    regions = _drop_unread(graph, _export_leaves(regions), producer, unread_writes, leaf_chains)
    return dataclasses.replace(part, regions=_marked_shared(regions))


def _marked_shared(regions) -> tuple[Region, ...]:
    """Each region with its ops that another kernel computes too (Region.shared): a recomputed op's
    copies and its original. XLA rounds each half-precision result; a copy of ours that kept it in
    float broke `x - max(x)` at the maximum: a float16 softmax over `x * x` recomputed the product
    unrounded and subtracted the maximum XLA found among the rounded ones, and its largest element
    came out `exp(0.0039)`, 0.4% off (H200). Rounded, copies of add, sub and mul (correctly rounded
    in float, then once to the half type) and of division (js_div is XLA's div.full) are XLA's to the
    bit."""
    copied = frozenset().union(*(r.recomputed for r in regions))
    return tuple(dataclasses.replace(r, shared=frozenset(op.index for op in r.ops if op.index in copied))
                 for r in regions)


def _outside(graph: ir.Graph, regions) -> list[ir.Op]:
    """The ops no region runs (a region's recomputed copies also run outside it)."""
    inside = {op.index for r in regions for op in r.ops if op.index not in r.recomputed}
    return [op for op in graph.ops if op.index not in inside]


def _read_once(graph: ir.Graph, part: Partition) -> set[ir.Value]:
    """Values made by an op and read by one region alone: nothing else (no other region, no op
    outside the regions, no program output) needs them written."""
    elsewhere = {a for op in _outside(graph, part.regions) for a in op.inputs if isinstance(a, ir.Value)}
    elsewhere |= {v for v in graph.outputs if isinstance(v, ir.Value)}
    regions_reading = collections.Counter(v for r in part.regions for v in r.inputs)
    made = {o for op in graph.ops for o in op.outputs}
    return {v for v, n in regions_reading.items() if n == 1 and v in made and v not in elsewhere}


def _drop_unread(graph: ir.Graph, regions: tuple[Region, ...], producer: dict,
                 rebuilt: bool = True, with_positions: bool = True) -> tuple[Region, ...]:
    """Region outputs that need not be written: those computed from positions alone (a causal mask
    broadcast over the attention scores) that no region input, op outside the regions or program
    output reads any more (their readers recompute them), and those that ops outside read only
    through gathers, made from the region's inputs by a short cheap chain (a loss's float32 copy of
    bfloat16 logits, of which a gather picks one element a row: written in full, it was as many
    bytes as the loss's gradient). With `rebuilt`, also those no one reads any more that a short
    cheap chain makes from values still written (a layernorm's float32 `x - mean`, which its
    backward region now recomputes from x; `with_positions`: and from values computed from positions
    alone, such as a causal mask, which the stitcher computes too: GPT's float32 exponentials of
    its masked scores); without it, any other value stays an output. The
    stitcher computes such a value again wherever an op left to XLA still needs it
    (stitcher.make_runner: a reader's region that XLA runs after all), where XLA fuses the chain
    into that op."""
    read = {v for r in regions for v in r.inputs} | {v for v in graph.outputs if isinstance(v, ir.Value)}
    outside = _outside(graph, regions)
    gathered = {op.inputs[0] for op in outside if op.prim == "gather" and isinstance(op.inputs[0], ir.Value)}
    read_outside = {a for op in outside for i, a in enumerate(op.inputs)
                    if isinstance(a, ir.Value) and not (op.prim == "gather" and i == 0)}
    kept_written = read | read_outside | set(graph.inputs)
    out = []
    for r in regions:
        def written(o):
            if o in read or o in read_outside:
                return True
            if o in gathered:
                return not _recomputable_from(o, set(r.inputs), producer)
            # (with `rebuilt`, a value only a reader's recomputed chain made: rebuilt from the
            # chain's leaves, which every reader's region reads, wherever XLA runs that reader)
            return not positions.positional(o, producer) and not (
                rebuilt and _recomputable_from(o, kept_written, producer, with_positions))
        kept = tuple(o for o in r.outputs if written(o))
        out.append(dataclasses.replace(r, outputs=kept) if kept and len(kept) < len(r.outputs) else r)
    return tuple(out)


def _recomputable_from(v: ir.Value, inputs: set[ir.Value], producer: dict, with_positions: bool = False) -> bool:
    """Whether `v` is made from `inputs` (and literals; with `with_positions`, values computed from
    positions alone) by at most MAX_CHAIN_OPS cheap ops."""
    stack, ops = [v], set()
    while stack:
        val = stack.pop()
        if val in inputs or (with_positions and positions.positional(val, producer)):
            continue
        op = producer.get(val.id)
        if op is None or not rebuildable(op):
            return False
        ops.add(op.index)
        if len(ops) > MAX_CHAIN_OPS:
            return False
        stack += [a for a in op.inputs if isinstance(a, ir.Value)]
    return True


def _export_leaves(regions: tuple[Region, ...]) -> tuple[Region, ...]:
    """A chain's leaf may be a value another region kept to itself (a row mean): that region now
    writes it too."""
    wanted = {v for r in regions for v in r.inputs}
    out = []
    for r in regions:
        extra = [o for op in r.ops if op.index not in r.recomputed for o in op.outputs
                 if o in wanted and o not in r.outputs and o not in r.inputs]
        out.append(dataclasses.replace(r, outputs=r.outputs + tuple(extra)) if extra else r)
    return tuple(out)


def _cheap(op: ir.Op) -> bool:
    """Elementwise, layout and source ops, and slices (a kernel reads a slice's elements of its
    operand in place: plan/views.py)."""
    return (op.prim in opdefs.ELEMENTWISE or op.prim in opdefs.LAYOUT or op.prim in opdefs.SOURCES
            or op.prim == "slice") and opdefs.unsupported_reason(op) is None


def rebuildable(op: ir.Op) -> bool:
    """A cheap op computing from operands (not a source): its result need not be written where its
    readers recompute it, and the stitcher runs it again for a reader left to XLA."""
    return _cheap(op) and op.prim not in opdefs.SOURCES


def _chain(v: ir.Value, producer: dict, own: set[int], read: set[ir.Value], table: bool = False) -> list[ir.Op]:
    """The cheap ops that make `v` from narrower values: an operand is expanded while it is as large
    and as wide as `v`, not read by the region already, and the chain has room; the rest are read.
    An operand computed from positions alone (a causal mask, graph/positions.py) is taken in whole,
    whatever its size: it reads nothing, and its producer need not write it; not where it holds an
    expensive op (rebuilt at the region's shape, at every element: see TABLE_RATIO). `table`: `v`
    is a table the region broadcasts (_is_table), and its expensive ops stay outside (read)."""
    chain: dict[int, ir.Op] = {}
    stack = [v]
    while stack:
        val = stack.pop()
        op = producer.get(val.id)
        if op is None or op.index in own or op.index in chain or not _cheap(op):
            continue
        if table and op.prim in opdefs.EXPENSIVE:
            continue
        if len(chain) == MAX_CHAIN_OPS:
            break
        chain[op.index] = op
        for a in op.inputs:
            if not isinstance(a, ir.Value) or a in read:
                continue
            if a.shape and positions.positional(a, producer) and not _expensive_cone(a, producer):
                chain.update((c.index, c) for c in positions.cone(a, producer) if c.index not in own)
            elif a.size >= v.size and a.itemsize >= v.itemsize and op.prim != "slice":
                stack.append(a)  # (a slice's operand is read, at the slice's elements alone)
    return sorted(chain.values(), key=lambda op: op.index)


# An input TABLE_RATIO times smaller than the region's largest value is a table the region
# broadcasts (a rotary embedding's [seq, half] cos and sin, which partition.py splits out of the
# regions it forms): its chain is taken in without its expensive ops, which the kernel would
# evaluate again at every element the table is broadcast to.
def _is_table(v: ir.Value, r: Region) -> bool:
    return v.size * TABLE_RATIO <= max((o.size for op in r.ops for o in op.outputs), default=0)


def _expensive_cone(v: ir.Value, producer: dict) -> bool:
    return any(op.prim in opdefs.EXPENSIVE for op in positions.cone(v, producer))


def _adopt_chains(r: Region, producer: dict, hidden: set[ir.Value], sole: set[ir.Value], fits,
                  leaf_chains: bool = True) -> Region:
    """Takes in each input's chain where that moves fewer bytes; then the chains of the leaves this
    left that no kernel writes yet (`hidden`), which would otherwise be written for this region
    alone, where they start from values already written: a softmax backward's exponentials
    recomputed from the scaled scores, which are one division by a constant from the scores the
    product wrote (GPT's attention: the forward kernel then writes the probabilities alone). Only
    such one-for-one trades (_swaps_for_written): with any chain of a leaf taken, BERT's
    masked-LM head backward came out heavier and was declined for its registers."""
    todo = sorted(r.inputs, key=lambda v: -v.size * v.itemsize)
    seen, first = set(todo), set(todo)
    saves_write = sole | hidden  # (taking in a leaf no kernel writes yet saves its write, as for one only r reads)
    while todo:
        v = todo.pop(0)
        if v.size <= 1 or v not in r.inputs:
            continue
        own = {op.index for op in r.ops}
        chain = _chain(v, producer, own, set(r.inputs) - {v}, _is_table(v, r))
        if not chain:
            continue
        candidate = _with_ops(r, chain)
        if v in candidate.inputs:
            continue
        if v not in first and not _swaps_for_written(v, candidate, r, hidden):
            continue
        extra = _new_bytes(candidate, r, hidden)
        if extra > MAX_BYTES_RATIO * _bytes_of(v, saves_write) and not (
                _unrounds(chain) and extra <= MAX_UNROUNDED_SHARE * _largest_bytes(r)):
            continue
        if fits(candidate):
            before = set(r.inputs)
            leaves = [a for a in candidate.inputs if leaf_chains and a not in before and a in hidden
                      and a not in seen]
            r = candidate
            seen.update(leaves)
            todo += sorted(leaves, key=lambda v: -v.size * v.itemsize)
    return r


def _swaps_for_written(v: ir.Value, candidate: Region, r: Region, hidden: set[ir.Value]) -> bool:
    """Whether `candidate` reads, instead of the unwritten `v`, one value no larger that a kernel
    writes anyway (and scalars): the one trade of a leaf for its own chain taken."""
    new = [a for a in candidate.inputs if a not in r.inputs and a.size > 1]
    return len(new) == 1 and new[0] not in hidden and new[0].nbytes <= v.nbytes


def _unrounds(chain: list[ir.Op]) -> bool:
    """Whether `chain` rounds a float to bfloat16 that our kernels compute with unrounded
    (wide_converts.py, JAXSTITCH_TUNE=wide_converts=1): a softmax's sum of exponentials, which its
    forward kernel then divides by unrounded. Its backward reads the float32 sum too, and divides
    by the same value, where it would otherwise read the rounded one: the identity its
    `p * (dp - sum(p * dp))` relies on, that the exponentials add up to their sum, then holds to
    float32 (with it, an attention block's exactly-0 key-bias gradient came out 0.6-1.0 from 0
    against 0.8-1.5 without, H100). The float32 sum costs twice the bytes of the
    rounded one, a row's value, next to the rows themselves."""
    return any(op.param(wide_converts.KEEP_FLOAT) for op in chain)


def _largest_bytes(r: Region) -> int:
    return max((v.nbytes for op in r.ops for v in op.inputs + op.outputs if isinstance(v, ir.Value)), default=0)


def _adopt_shared_leaves(r: Region, producer: dict, hidden: set[ir.Value], sole: set[ir.Value],
                         fits) -> Region:
    """Inputs made by cheap chains from one full-size value, taken in together: a float32
    layernorm backward reads `x - mean` and `2 * x`, each alone as many bytes as `x` (and `x`'s
    write, where no kernel writes it yet), which _adopt_chains turns down one by one; together they
    cost one read of `x` against two inputs' reads and writes."""
    shared: dict[ir.Value, list[ir.Value]] = {}
    own = {op.index for op in r.ops}
    for v in r.inputs:
        op = producer.get(v.id)
        if v.size <= 1 or op is None or op.index in own or not _cheap(op):
            continue
        for a in dict.fromkeys(a for a in op.inputs if isinstance(a, ir.Value)):
            made_by = producer.get(a.id)
            # (a broadcast row value is no shared leaf: _chain takes it in, reading the row)
            if a.size == v.size and a not in r.inputs and (made_by is None or made_by.prim != "broadcast_in_dim"):
                shared.setdefault(a, []).append(v)
    for x, members in shared.items():
        if len(members) < 2 or any(v not in r.inputs for v in members):
            continue
        own = {op.index for op in r.ops}
        read = (set(r.inputs) - set(members)) | {x}
        chain = {op.index: op for v in members for op in _chain(v, producer, own, read, _is_table(v, r))}
        candidate = _with_ops(r, sorted(chain.values(), key=lambda op: op.index))
        if any(v in candidate.inputs for v in members):
            continue
        if _new_bytes(candidate, r, hidden) <= MAX_BYTES_RATIO * sum(_bytes_of(v, sole) for v in members) \
                and fits(candidate):
            r = candidate
    return r


def _new_bytes(candidate: Region, r: Region, hidden: set[ir.Value]) -> int:
    """What `candidate` reads that `r` did not (of an input read only through slices, their
    elements); a leaf no kernel writes yet costs its write too."""
    return sum(_read_bytes(a, candidate) * (2 if a in hidden else 1)
               for a in candidate.inputs if a not in r.inputs)


def _read_bytes(a: ir.Value, r: Region) -> int:
    """The bytes of `a` that `r`'s kernel loads: the slices' elements where only slices read it
    (a SwiGLU's gate and up halves of one product), else all of it."""
    readers = [op for op in r.ops if a in op.inputs]
    if readers and all(op.prim == "slice" for op in readers):
        return min(a.size, sum(op.outputs[0].size for op in readers)) * a.itemsize
    return a.size * a.itemsize


def _bytes_of(v: ir.Value, sole: set[ir.Value]) -> int:
    """What reading `v` costs: its read, and its write where only this region reads it (once its
    chain is taken in, its producer no longer writes it: a layernorm backward's float32 `x - mean`,
    where the forward pass then writes the bfloat16 x)."""
    return v.size * v.itemsize * (2 if v in sole else 1)


def _with_ops(r: Region, chain: list[ir.Op]) -> Region:
    ops = tuple(sorted((*r.ops, *chain), key=lambda op: op.index))
    produced = {o.id for op in ops for o in op.outputs}
    inputs = tuple(dict.fromkeys(a for op in ops for a in op.inputs
                                 if isinstance(a, ir.Value) and a.id not in produced))
    return dataclasses.replace(r, ops=ops, inputs=inputs,
                               recomputed=r.recomputed | frozenset(op.index for op in chain))
