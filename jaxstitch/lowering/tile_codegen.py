"""Render a TilePlan (plan/tile.py) as CUDA C: one block per batch element's tile, epoch by epoch.

Each step of the plan becomes one loop of the block's threads (or straight-line code at row scope);
a block barrier ends every epoch. Inside a loop each value is a C expression: a stashed input or a
shared-memory array read at the loop's indices `a` / `b`, a register, or (inline values) a local
computed once per loop iteration from its operands.

Row-scope reductions over an axis of at most SLOTS * 32 elements walk it in *slots*: lane l takes
elements l, l + 32, ... in an unrolled loop, and an inline value along that axis, once computed in
one of them, stays in a register array indexed by the slot for the epoch's later loops (a softmax's
scores, masks and exponentials are computed once, not once per statistic).
"""
from __future__ import annotations

import string

from ..core import ir
from ..core import ops as opdefs
from ..plan import tile as T
from .cuda_ops import (
    CTYPE,
    REDUCE,
    STYPE,
    as_written,
    as_xla_rounds,
    bool_factor,
    expression,
    literal,
    rounded_float,
    select_product,
    written_half,
)
from .kernel import KERNEL_NAME, Source, Unrenderable, Writer, template

_SIZE = {T.N: "N_ROWS", T.A: "TA", T.B: "TB"}
SLOTS = 4  # at most this many elements of an axis a lane for slot loops (registers per cached value)
_INDEX = {T.N: "row", T.A: "a", T.B: "b"}


def _index(kind: str) -> str:
    """Flat index of element (row, a, b) of a value spanning `kind`'s axes (row-major)."""
    idx = ""
    for axis in kind:
        idx = _INDEX[axis] if not idx else f"({idx}) * {_SIZE[axis]} + {_INDEX[axis]}"
    return idx or "0"


class _Emitter:
    def __init__(self, plan: T.TilePlan):
        self.plan = plan
        self.inputs = {v.id: i for i, v in enumerate(plan.region.inputs)}
        self.outputs = list(plan.region.outputs)
        self.rounds_written = written_half(plan.region, self.inputs, plan.root)
        self.producer = {o.id: op for op in plan.region.ops for o in op.outputs}
        self.consts = {op.outputs[0].id: op.inputs[0] for op in plan.region.ops
                       if opdefs.is_layout(op) and isinstance(op.inputs[0], ir.Const)}
        self.epoch = 0
        self.w: Writer | None = None
        self.memo: dict[int, str] = {}
        self.tmp = 0
        self.slots: dict[int, str] = {}   # inline values kept per slot this epoch -> register array
        self.slot_axis = ""               # the axis the current loop walks in slots ("": not a slot loop)
        self.slot_decls: list[str] = []
        self.vectors: set[int] = set()    # stashed inputs read as one vector per step of a width loop
        # A warp on each tile (plan/tile.teams) reads stashed inputs as vectors, and its EACH loops keep
        # b fixed: its shared-memory wavefronts bound it. A block on DIEN's float32 tile, bound by
        # global memory, ran 94.3 -> 102.5 us with them (H100): not there.
        self.by_warp = plan.mapping.teams > 1

    # ---- values -------------------------------------------------------------------------------
    def ctype(self, v: ir.Value) -> str:
        return CTYPE[v.dtype]

    def ref(self, a: ir.Atom, stored: bool = False) -> str:
        """`a`'s C expression; a half-precision value the kernel also writes is read rounded, as
        written (cuda_ops.written_half), except by its store (`stored`)."""
        expr = self._ref(a)
        if stored or not isinstance(a, ir.Value):
            return expr
        return as_written(self.rounds_written, self.plan.root(a.id), expr)

    def _ref(self, a: ir.Atom) -> str:
        if isinstance(a, ir.Const):
            return literal(a.value, a.dtype)
        rid = self.plan.root(a.id)
        if rid in self.memo:  # made in this loop body already
            return self.memo[rid]
        if rid in self.consts:
            return literal(self.consts[rid].value, a.dtype)
        t = self.plan.of(a)
        v = t.value
        if t.home == T.STASH and v.id in self.vectors:
            return f"js_p{v.id}[u]"
        if t.home == T.STASH:  # (a transposed input lies in shared memory as in global memory)
            full = "b * TA + a" if t.order else "a * TB + b"
            idx = {T.FULL: full, T.A: "a", T.B: "b", T.ROW: "0"}[t.domain]
            return f"sm{v.id}[{idx}]" if t.wide else f"js_io<{STYPE[v.dtype]}>::get(sm{v.id}[{idx}])"
        if t.home == T.GLOBAL:
            return f"js_io<{STYPE[v.dtype]}>::get(in{self.inputs[v.id]}[{_index(t.order or t.kind)}])"
        if t.home == T.ARRAY and (t.epoch < 0 or self.epoch >= t.array_epoch):
            return f"sm{v.id}[{_INDEX[t.domain]}]"
        if t.home == T.REG:
            return f"r{v.id}"
        return self.inline(t)

    def inline(self, t: T.TileValue) -> str:
        """The value computed in the current loop body, once."""
        vid = t.value.id
        if vid not in self.memo and self.slot_axis and t.domain == self.slot_axis:
            if vid not in self.slots:
                self.slots[vid] = f"v{vid}_{self.epoch}"
                self.slot_decls.append(f"{self.ctype(t.value)} v{vid}_{self.epoch}[{self.slot_count}];")
                self.w(f"v{vid}_{self.epoch}[j] = {self.expr(self.producer[vid])};")
            self.memo[vid] = f"{self.slots[vid]}[j]"
        if vid not in self.memo:
            op = self.producer[vid]
            name = f"t{vid}_{self.tmp}"
            self.w(f"const {self.ctype(t.value)} {name} = {self.expr(op)};")
            self.memo[vid] = name
        return self.memo[vid]

    def expr(self, op: ir.Op) -> str:
        out = op.outputs[0]
        if op.prim == "iota":
            return f"({self.ctype(out)})({_INDEX[self.plan.of(out).iota_axis]})"
        found = bool_factor(op, self.producer)  # x * convert(pred) as pred ? x : 0
        if found is not None:
            i, pred = found
            other = self.ref(op.inputs[1 - i])  # (first: ref may compute an inline value)
            return select_product(self.ref(pred), other, self.ctype(out))
        return as_xla_rounds(op, expression(op, [self.ref(a) for a in op.inputs], self.plan.fast_exp),
                             self.plan.region.shared)

    def length(self, axis: str) -> int:
        return {T.A: self.plan.mapping.tile_a, T.B: self.plan.mapping.tile_b}[axis]

    @property
    def slot_count(self) -> int:
        return -(-self.length(self.slot_axis) // 32)

    def slotted(self, axis: str) -> bool:
        """Whether loops over `axis` at row scope walk it in slots."""
        return self.length(axis) <= SLOTS * 32

    def body(self, w: Writer):
        """A fresh loop body: inline values are computed again inside it."""
        self.w, self.memo = w, {}
        self.tmp += 1  # names unique per body: row-scope bodies share one C scope

    # ---- stores ---------------------------------------------------------------------------------
    def stores_of(self, vid: int, axis: str) -> list[tuple[int, ir.Value]]:
        """The outputs that are value `vid` along `axis` alone (the loop storing them walks it): an
        output that broadcasts it over the other axis too is a whole tile, stored by a tile loop."""
        return [(j, o) for j, o in enumerate(self.outputs)
                if self.plan.root(o.id) == vid and self.plan.out_kind(o).replace(T.N, "") == axis]

    def stored(self, o: ir.Value) -> str:
        """The expression an output is stored from (cuda_ops.rounded_float: a float rounded to the
        output's half type is stored from the float)."""
        op = self.producer.get(self.plan.root(o.id))
        src = rounded_float(op) if op is not None and op.outputs[0].dtype == o.dtype else None
        return self.ref(o if src is None else src, stored=True)

    def store(self, w: Writer, j: int, o: ir.Value, expr: str, guard: str = ""):
        w(f"{'if (' + guard + ') ' if guard else ''}out{j}[{_index(self.plan.out_kind(o))}] = "
          f"js_io<{STYPE[o.dtype]}>::put({expr});")


def _reduce(op: ir.Op):
    ctype = CTYPE[op.outputs[0].dtype]
    if op.prim not in REDUCE:
        raise Unrenderable(f"{op.prim} in a tile")
    functor, ident = REDUCE[op.prim]
    return ctype, functor, ident[ctype]


def _row_step(em: _Emitter, w: Writer, step: T.TileStep):
    em.body(w)
    for op in step.finish:  # whole-tile reductions: the warps' partials, in warp order
        out = op.outputs[0]
        ct, fn, ident = _reduce(op)
        t = em.plan.of(out)
        w(f"{ct} r{out.id} = {ident};")
        w(f"for (int w = 0; w < NWARPS; ++w) r{out.id} = {fn}(r{out.id}, reinterpret_cast<const {ct}*>(js_dyn + {t.partial_offset})[w]);")
    for op in step.ops:
        out = op.outputs[0]
        if op.prim in opdefs.REDUCTIONS:  # along a or b: every warp walks the axis itself
            red = (op, *_reduce(op))
            axis = em.plan.of(op.inputs[0]).domain
            var = _INDEX[axis]
            w(f"{red[1]} r{out.id};")
            w("{")
            inner = Writer(w.indent + 1)
            if em.slotted(axis):
                em.slot_axis = axis
                _fold(em, inner, [red], f"for (int j = 0; j < {em.slot_count}; ++j)",
                      first=_slot_index(axis), unroll=True)
                em.slot_axis = ""
            else:
                _fold(em, inner, [red], f"for (int {var} = lane; {var} < {_SIZE[axis]}; {var} += 32)")
            inner(f"r{out.id} = js_group_reduce<32>(acc{out.id}, {red[2]});")
            w.lines.extend(inner.lines)
            w("}")
            em.body(w)
        else:
            w(f"const {em.ctype(out)} r{out.id} = {em.expr(op)};")
    for o in step.stores:
        guard = "tid == 0" + ("" if T.N in em.plan.out_kind(o) else " && row == 0")
        em.store(w, em.outputs.index(o), o, em.ref(o), guard)


def _slot_index(axis: str) -> str:
    var = _INDEX[axis]
    return f"const int {var} = lane + 32 * j; if ({var} >= {_SIZE[axis]}) continue;"


def _each(em: _Emitter, w: Writer, step: T.TileStep):
    """A loop over the tile's elements, b fastest; a fastest when it stores only transposed tiles
    (each warp's stores then contiguous, the reads transposed in shared memory). Where every store
    is a whole tile in (n, a, b) order, a thread takes `_store_width` consecutive b at once and
    stores them as one vector: the index arithmetic and the store are paid once per vector."""
    reds = [(op, *_reduce(op)) for op in step.ops]
    transposed = step.stores and all(em.plan.out_kind(o).endswith(T.B + T.A) for o in step.stores)
    width = 1 if transposed else _store_width(em, step.stores)
    lanes = em.length(T.B) // width  # threads a row of the tile takes, `width` b each
    rows = T.fixed_b_rows(em.plan.mapping.team, em.length(T.B), width) if em.by_warp else 0
    if rows:  # rows of the tile at once
        w(f"const int b0 = (tid % {lanes}) * {width};  // the same b in every step")
        _fold(em, w, reds, f"for (int a = tid < {rows * lanes} ? tid / {lanes} : TA; a < TA; a += {rows})",
              first="const int i0 = a * TB + b0;", stores=step.stores, width=width, fixed_b=True)
    elif width > 1:
        _fold(em, w, reds, f"for (int i0 = tid * {width}; i0 < TILE; i0 += BLOCK * {width})",
              first="const int a = i0 / TB, b0 = i0 % TB;", stores=step.stores, width=width)
    else:
        first = "const int b = i / TA, a = i % TA;" if transposed else "const int a = i / TB, b = i % TB;"
        _fold(em, w, reds, "for (int i = tid; i < TILE; i += BLOCK)", first=first, stores=step.stores)
    for op, ct, fn, ident in reds:
        out = op.outputs[0]
        w(f"acc{out.id} = js_group_reduce<32>(acc{out.id}, {fn});")
        w(f"if (lane == 0) reinterpret_cast<{ct}*>(js_dyn + {em.plan.of(out).partial_offset})[warp] = acc{out.id};")


def _fold(em: _Emitter, w: Writer, reds, loop_head: str, first: str = "", stores=(), width: int = 1,
          unroll: bool = False, per_column: bool = False, fixed_b: bool = False):
    """The reductions' accumulators set to their identities, then folded over `loop_head`'s
    iterations (inline values computed again in each, after `first`); `stores`: outputs stored in
    each iteration. `width` > 1: each iteration walks b0 .. b0 + width - 1 and stores each output's
    `width` values as one vector at (row, a, b0); `per_column`: each reduction keeps an accumulator
    for each of those b (`acc[u]`), where it reduces along a; `fixed_b`: b0 is the same in every
    iteration (stashed inputs along b are then read once, before the loop; see _vector_reads)."""
    for op, ct, fn, ident in reds:
        init = "{" + ", ".join([ident] * width) + "}" if per_column else ident
        w(f"{ct} acc{op.outputs[0].id}{f'[{width}]' if per_column else ''} = {init};")
    if width > 1 and fixed_b:
        _vector_reads(em, w, width, (T.B,))
    if unroll:
        w("#pragma unroll")
    w(loop_head + " {")
    outer = Writer(w.indent + 1)
    if first:
        outer(first)
    body = outer
    if width > 1:
        for j, o in _indexed(em, stores):
            outer(f"{em.ctype(o)} js_v{j}[{width}];")
        if em.by_warp:
            _vector_reads(em, outer, width, (T.FULL,) if fixed_b else (T.FULL, T.B))
        outer("#pragma unroll")
        outer(f"for (int u = 0; u < {width}; ++u) {{")
        body = Writer(outer.indent + 1)
        body("const int b = b0 + u;")
    em.body(body)
    for op, ct, fn, ident in reds:
        acc = f"acc{op.outputs[0].id}" + ("[u]" if per_column else "")
        body(f"{acc} = {fn}({acc}, ({ct})({em.ref(op.inputs[0])}));")
    for j, o in _indexed(em, stores):
        if width > 1:
            body(f"js_v{j}[u] = {em.stored(o)};")
        else:
            em.store(body, j, o, em.stored(o))
    if width > 1:
        outer.lines.extend(body.lines)
        outer("}")
        for j, o in _indexed(em, stores):
            outer(f"js_store<{STYPE[o.dtype]}, {width}>(out{j} + (row) * TILE + i0, js_v{j});")
    w.lines.extend(outer.lines)
    w("}")
    em.vectors = set()


def _vector_reads(em: _Emitter, w: Writer, width: int, domains: tuple[str, ...]):
    """A width loop's step walks b0 .. b0 + width - 1 (b0 a multiple of width, as TB is): a stashed
    input in tile order along one of `domains` (the whole tile, or b) is read there as one vector of
    4, 8 or 16 bytes (`js_p<id>[u]` in the step's body) instead of element by element. Shared
    memory's wavefronts bound a warp working on DIEN's whole bfloat16 tile (L1 84% busy), where its
    keys took two 2-byte reads a pair of b and its float query one read a b (H100, Nsight Compute,
    same call: 9.3 -> 7.8M shared-memory wavefronts, 55.4 -> 51.9 us). A read no op uses is dead
    code the compiler drops."""
    for t in em.plan.values:
        v = t.value
        if t.home != T.STASH or t.order or t.domain not in domains:
            continue
        held = _held(t)
        if width * (4 if t.wide else v.itemsize) not in (4, 8, 16):
            continue
        at = "a * TB + b0" if t.domain == T.FULL else "b0"
        w(f"{'float' if t.wide else CTYPE[v.dtype]} js_p{v.id}[{width}];")  # (an integer stays one)
        w(f"js_load<{held}, {width}>(sm{v.id} + {at}, js_p{v.id});")
        em.vectors.add(v.id)


def _indexed(em: _Emitter, stores) -> list[tuple[int, ir.Value]]:
    return [(em.outputs.index(o), o) for o in stores]


def _store_width(em: _Emitter, stores) -> int:
    """plan/tile.store_width for these stores."""
    return T.store_width(em.length(T.B), [em.plan.out_kind(o) for o in stores],
                         max([o.itemsize for o in stores], default=0))


def _along_b(em: _Emitter, w: Writer, step: T.TileStep):
    """For each a, a group of GROUP lanes reduces over b (shuffles inside the group); a lane takes
    b two at a time where the mapping takes pairs (plan/tile.takes_pairs), four where it walks a
    whole row alone (a group of one lane: a warp's tile) and TB allows: its half-precision row then
    comes as 8-byte reads, and the float inputs along b as 16-byte ones (_vector_reads)."""
    reds = [(op, *_reduce(op)) for op in step.ops]
    with w.block("for (int a0 = 0; a0 < TA; a0 += BLOCK / GROUP) {  // the same trip count in every lane"):
        w("const int a = a0 + tid / GROUP;")
        if em.by_warp and em.plan.mapping.pairs and em.plan.mapping.group == 1 and em.length(T.B) % 4 == 0:
            _fold(em, w, reds, "if (a < TA) for (int b0 = 0; b0 < TB; b0 += 4)", width=4)
        elif em.plan.mapping.pairs:
            _fold(em, w, reds, "if (a < TA) for (int b0 = 2 * (tid % GROUP); b0 < TB; b0 += 2 * GROUP)", width=2)
        else:
            _fold(em, w, reds, "if (a < TA) for (int b = tid % GROUP; b < TB; b += GROUP)")
        for op, ct, fn, ident in reds:
            w(f"acc{op.outputs[0].id} = js_group_reduce<GROUP>(acc{op.outputs[0].id}, {fn});")
        with w.block("if (a < TA && tid % GROUP == 0) {"):
            for op, ct, fn, ident in reds:
                out = op.outputs[0]
                w(f"sm{out.id}[a] = acc{out.id};")
                for j, o in em.stores_of(out.id, T.A):
                    em.store(w, j, o, f"acc{out.id}")


def _along_a(em: _Emitter, w: Writer, step: T.TileStep):
    """For each b, SLICES consecutive-thread slices each reduce every SLICES-th a; partials per slice,
    combined in MAP_B (in slice order). Where the mapping takes pairs, a thread takes two consecutive
    b, with an accumulator for each."""
    reds = [(op, *_reduce(op)) for op in step.ops]
    if em.plan.mapping.pairs:
        _along_a_pairs(em, w, reds)
        return
    with w.block("for (int t = tid; t < SLICES * TB; t += BLOCK) {"):
        w("const int b = t % TB, s = t / TB;")
        _fold(em, w, reds, "for (int a = s; a < TA; a += SLICES)")
        for op, ct, fn, ident in reds:
            out = op.outputs[0]
            w(f"reinterpret_cast<{ct}*>(js_dyn + {em.plan.of(out).partial_offset})[t] = acc{out.id};")


def _each_along_a(em: _Emitter, w: Writer, step: T.TileStep):
    """A warp's whole-tile stores and its sums over a in one loop (plan/tile._each_along_a): thread
    `tid` takes `width` consecutive b from b0 and, as slice s, every SLICES-th a from s, storing each
    step's vectors and folding the same elements into its b's accumulators; partials as ALONG_A's."""
    reds = [(op, *_reduce(op)) for op in step.ops]
    width = _store_width(em, step.stores)
    lanes = em.length(T.B) // width
    busy = em.plan.mapping.slices * lanes
    w(f"const int b0 = (tid % {lanes}) * {width}, s = tid / {lanes};  // the same b in every step")
    _fold(em, w, reds, f"for (int a = tid < {busy} ? s : TA; a < TA; a += SLICES)",
          first="const int i0 = a * TB + b0;", stores=step.stores, width=width, per_column=True, fixed_b=True)
    with w.block(f"if (tid < {busy}) {{"):
        w("#pragma unroll")
        with w.block(f"for (int u = 0; u < {width}; ++u) {{"):
            for op, ct, fn, ident in reds:
                out = op.outputs[0]
                w(f"reinterpret_cast<{ct}*>(js_dyn + {em.plan.of(out).partial_offset})[s * TB + b0 + u] = "
                  f"acc{out.id}[u];")


def _along_a_pairs(em: _Emitter, w: Writer, reds):
    with w.block("for (int t = tid; t < SLICES * (TB / 2); t += BLOCK) {"):
        w("const int b0 = 2 * (t % (TB / 2)), s = t / (TB / 2);")
        _fold(em, w, reds, "for (int a = s; a < TA; a += SLICES)", width=2, per_column=True)
        for op, ct, fn, ident in reds:
            out = op.outputs[0]
            part = f"reinterpret_cast<{ct}*>(js_dyn + {em.plan.of(out).partial_offset})"
            w(f"{part}[s * TB + b0] = acc{out.id}[0];")
            w(f"{part}[s * TB + b0 + 1] = acc{out.id}[1];")


def _map(em: _Emitter, w: Writer, step: T.TileStep, axis: str, one_warp: bool = False):
    """Materializes values along `axis` (threads over it; one warp's lanes, in slots where the
    epoch's row reductions walked it so, when the epoch is the first warp's alone)."""
    var = _INDEX[axis]
    body = Writer(w.indent + 1)
    if one_warp and em.slotted(axis):
        em.slot_axis = axis
        w("#pragma unroll")
        w(f"for (int j = 0; j < {em.slot_count}; ++j) {{")
        body(_slot_index(axis))
    elif one_warp:
        w(f"for (int {var} = lane; {var} < {_SIZE[axis]}; {var} += 32) {{")
    else:
        w(f"for (int {var} = tid; {var} < {_SIZE[axis]}; {var} += BLOCK) {{")
    em.body(body)
    for op in step.finish:  # ALONG_A partials, in slice order
        out = op.outputs[0]
        ct, fn, ident = _reduce(op)
        part = f"reinterpret_cast<const {ct}*>(js_dyn + {em.plan.of(out).partial_offset})"
        body(f"{ct} s{out.id} = {ident};")
        body(f"for (int s = 0; s < SLICES; ++s) s{out.id} = {fn}(s{out.id}, {part}[s * TB + b]);")
        body(f"sm{out.id}[b] = s{out.id};")
        em.memo[out.id] = f"s{out.id}"  # for ops of this loop made from it (the array is read next epoch)
        for j, o in em.stores_of(out.id, T.B):
            em.store(body, j, o, f"s{out.id}")
    for op in step.ops:
        out = op.outputs[0]
        x = em.inline(em.plan.of(out))
        body(f"sm{out.id}[{var}] = {x};")
        for j, o in em.stores_of(out.id, axis):
            em.store(body, j, o, x)
    for o in step.stores:  # outputs along the axis that name an input, a register or a literal
        em.store(body, em.outputs.index(o), o, em.ref(o))
    em.slot_axis = ""
    w.lines.extend(body.lines)
    w("}")


def _staging(em: _Emitter, pro: Writer, top: Writer, end: Writer):
    """Stashed inputs: the first tile's copies before the loop; in the loop, the next tile's copies
    into the other stage buffer (asynchronous; through registers stored at once, VECTORS; or through
    registers stored at the tile's end, REGS), and the current buffer's pointers."""
    plan, m = em.plan, em.plan.mapping
    stashed = [v for v in plan.region.inputs if plan.of(v).home == T.STASH]
    pro("if (js_first < N_ROWS) {")
    for v in stashed:
        t, st, count = plan.of(v), STYPE[v.dtype], v.size // m.n_rows
        src = f"in{em.inputs[v.id]} + js_first * {count}"
        fn = ("js_block_copy_async" if t.copy in (T.ASYNC, T.VECTORS) else
              "js_block_copy_wide" if t.wide else "js_block_copy")
        pro(f"  {fn}<{st}, {count}, BLOCK>({_stage(t, st, '0')}, {src}, tid);")
    pro("}")
    pro("js_stage_commit();")
    for v in stashed:
        t, st, count = plan.of(v), STYPE[v.dtype], v.size // m.n_rows
        src, nxt = f"in{em.inputs[v.id]}", _stage(t, st, "js_buf ^ 1")
        if t.copy == T.ASYNC:
            top(f"if (js_more) js_block_copy_async<{st}, {count}, BLOCK>({nxt}, {src} + js_next * {count}, tid);")
        elif t.copy == T.VECTORS:  # 16-byte vectors through registers, stored at once
            n = count * v.itemsize // 16
            k = -(-n // m.team)
            top("#pragma unroll")
            top(f"for (int k = 0; k < {k}; ++k) if (js_more && tid + k * BLOCK < {n}) "
                f"reinterpret_cast<uint4*>({nxt})[tid + k * BLOCK] = "
                f"__ldg(reinterpret_cast<const uint4*>({src} + js_next * {count}) + tid + k * BLOCK);")
        elif t.copy == T.SYNC:
            top(f"if (row != js_first) js_block_copy<{st}, {count}, BLOCK>({_stage(t, st, 'js_buf')}, {src} + row * {count}, tid);")
        else:
            k = -(-count // m.team)
            top(f"{st} pf{v.id}[{k}];")
            top(f"for (int k = 0; k < {k}; ++k) if (js_more && tid + k * BLOCK < {count}) "
                f"pf{v.id}[k] = {src}[js_next * {count} + tid + k * BLOCK];")
            get = f"js_io<{st}>::get(pf{v.id}[k])" if t.wide else f"pf{v.id}[k]"
            end(f"for (int k = 0; k < {k}; ++k) if (js_more && tid + k * BLOCK < {count}) "
                f"{nxt}[tid + k * BLOCK] = {get};")
    top("js_stage_commit();")
    return [f"const {_held(plan.of(v))}* sm{v.id} = {_stage(plan.of(v), STYPE[v.dtype], 'js_buf')};" for v in stashed]


def _held(t: T.TileValue) -> str:
    """The type a stashed input has in shared memory."""
    return "float" if t.wide else STYPE[t.value.dtype]


def _stage(t: T.TileValue, st: str, buf: str) -> str:
    return f"reinterpret_cast<{_held(t)}*>(js_dyn + {t.offset} + ({buf}) * STAGE)"


def render(plan: T.TilePlan):
    em = _Emitter(plan)
    region, m = plan.region, plan.mapping
    params = [f"const {STYPE[v.dtype]}* __restrict__ in{i}" for i, v in enumerate(region.inputs)]
    params += [f"{STYPE[v.dtype]}* __restrict__ out{j}" for j, v in enumerate(region.outputs)]
    arrays = Writer(1)
    for t in plan.values:
        if t.home == T.ARRAY:
            ct = em.ctype(t.value)
            arrays(f"{ct}* sm{t.value.id} = reinterpret_cast<{ct}*>(js_dyn + {t.offset});")
    pro, top, end, body = Writer(1), Writer(2), Writer(2), Writer(2)
    for line in _staging(em, pro, top, end):
        body(line)
    last = max(s.epoch for s in plan.steps)
    for epoch in range(last + 1):
        em.epoch, em.slots, em.slot_decls = epoch, {}, []
        one_warp = epoch in plan.one_warp
        body(f"// epoch {epoch}" + (": the first warp alone" if one_warp else ""))
        if one_warp:
            body("if (warp == 0) {")
            body.indent += 1
        decl_at = len(body.lines)
        for s in (s for s in plan.steps if s.epoch == epoch):
            w = Writer(body.indent + 1)
            em.body(w)
            if s.loop == T.ROW_STEP:
                _row_step(em, body, s)
                continue
            elif s.loop == T.EACH:
                _each(em, w, s)
            elif s.loop == T.ALONG_B:
                _along_b(em, w, s)
            elif s.loop == T.ALONG_A:
                _along_a(em, w, s)
            elif s.loop == T.EACH_ALONG_A:
                _each_along_a(em, w, s)
            else:
                _map(em, w, s, T.A if s.loop == T.MAP_A else T.B, one_warp)
            body("{")
            body.lines.extend(w.lines)
            body("}")
        body.lines[decl_at:decl_at] = ["  " * body.indent + d for d in em.slot_decls]
        if one_warp:
            body.indent -= 1
            body("}")
        if epoch < last:
            body("JS_TILE_SYNC();")
    summary = f"{len(region.ops)} ops, tiles of {m.tile_a}x{m.tile_b}, {plan.description}"
    code = string.Template(template("tile_kernel.cu")).substitute(
        summary=summary, common=template("stitch_common.cuh"), ta=m.tile_a, tb=m.tile_b,
        teams=m.teams, team=m.team, team_smem=m.team_smem, group=m.group, slices=m.slices, stage=m.stage_bytes,
        min_blocks=m.min_blocks, name=KERNEL_NAME,
        params=", ".join(params), arrays=arrays.text(), prologue=pro.text(), loop_top=top.text(),
        body=body.text(), loop_end=end.text())
    return Source(code, KERNEL_NAME, tuple(params))
