"""Render a ScanPlan (plan/scan.py) as CUDA C: the step's ops as loops of the block over each
value's elements in shared memory, inside a loop over the steps.

Every loop gives element i of its result to thread i % BLOCK, whatever the op; so an op reading its
operands at its own index (elementwise over one shape) reads what the same thread wrote, and needs no
barrier. Any other read (a matrix product, a transpose, a broadcast, a split) waits at a block
barrier for what other threads wrote since the last one.
"""
from __future__ import annotations

import math
import string

from ..core import ir
from ..core import ops as opdefs
from ..plan import scan as S
from .cuda_ops import CTYPE, REDUCE, STYPE, expression, literal
from .kernel import KERNEL_NAME, Source, Writer, template


def _strides(shape) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def _digits(shape, var: str) -> list[str]:
    """C expressions of the multi-index of flat element `var` of a row-major `shape`."""
    out = []
    for d, (n, st) in enumerate(zip(shape, _strides(shape))):
        if n == 1:
            out.append("0")
            continue
        q = var if st == 1 else f"({var} / {st})"
        out.append(q if d == 0 else f"({q} % {n})")
    return out


def _flat(shape, digits) -> str:
    terms = [d if st == 1 else f"{d} * {st}" for n, st, d in zip(shape, _strides(shape), digits)
             if n != 1 and d != "0"]
    return " + ".join(terms) or "0"


class _Emitter:
    def __init__(self, plan: S.ScanPlan):
        self.plan = plan
        self.body = plan.body
        self.root: dict[int, int] = {}
        for op in self.body.ops:
            if op.prim in S.RENAMES and isinstance(op.inputs[0], ir.Value):
                self.root[op.outputs[0].id] = self.root.get(op.inputs[0].id, op.inputs[0].id)
        self.scalars: set[int] = {v for v, k in plan.kinds if k.kind == S.SCALAR}
        self.dirty: set[int] = set()
        # products summed into a carry as they are computed (dot's index -> the carry's value); the
        # carry's new value is the carry's own array
        sums = {s.carry: s for s in plan.in_place}
        self.into: dict[int, tuple[S.InPlaceSum, ir.Value]] = {}
        for v, new in plan.carries:
            if v.id in sums:
                self.into[sums[v.id].dot] = (sums[v.id], v)
                self.root[new.id] = v.id

    def kind(self, a) -> S.Kind:
        return self.plan.kind(a)

    def shape(self, v: ir.Value) -> tuple[int, ...]:
        return self.plan.local_shape(v)

    def size(self, v: ir.Value) -> int:
        return math.prod(self.shape(v))

    def ref(self, a: ir.Atom, idx: str) -> str:
        if isinstance(a, ir.Const):
            return literal(a.value, a.dtype)
        if a.id in self.scalars:
            return f"r{a.id}"
        return f"s{self.root.get(a.id, a.id)}[{idx}]"

    def storage(self, a: ir.Atom) -> int | None:
        if isinstance(a, ir.Const) or a.id in self.scalars:
            return None
        return self.root.get(a.id, a.id)

    def sync_for(self, w: Writer, reads, same_index: bool):
        """A barrier before an op reading these atoms, where another thread may have written them."""
        ids = {s for s in (self.storage(a) for a in reads) if s is not None}
        if ids & self.dirty and not same_index:
            w("__syncthreads();")
            self.dirty.clear()

    # ---- ops ----------------------------------------------------------------------------------
    def op(self, w: Writer, op: ir.Op, index: int):
        out = op.outputs[0]
        if (op.prim in S.RENAMES and out.id not in self.scalars) or index in self.plan.elided:
            return
        if out.id in self.scalars:
            # a broadcast value: every thread keeps it in a register (reading element 0 of a
            # size-1 array another thread may have written)
            src = [a for a in op.inputs if isinstance(a, ir.Value) and a.id not in self.scalars]
            self.sync_for(w, src, same_index=False)
            args = [self.ref(a, "0") for a in op.inputs]
            expr = args[0] if op.prim in S.RENAMES or op.prim == "broadcast_in_dim" else expression(op, args)
            w(f"const {CTYPE[out.dtype]} r{out.id} = {expr};")
            return
        elementwise = op.prim in opdefs.ELEMENTWISE
        # (lax broadcasts size-1 axes of an elementwise op's operands: those read other elements)
        same = elementwise and all(self.storage(a) is None or self.shape(a) == self.shape(out) for a in op.inputs)
        self.sync_for(w, op.inputs, same_index=same)
        if elementwise:
            with self.loop(w, out):
                d = _digits(self.shape(out), "i")
                w(f"s{out.id}[i] = {expression(op, [self._at(a, out, d) for a in op.inputs])};")
        elif index in self.into:
            self._dot_general(w, op, *self.into[index])
        else:
            getattr(self, "_" + op.prim)(w, op)
        self.dirty.update(o.id for o in op.outputs)

    def _at(self, a: ir.Atom, out: ir.Value, digits: list[str]) -> str:
        """Operand `a` of an elementwise op at the element `digits` of its result `out`."""
        if self.storage(a) is None or self.shape(a) == self.shape(out):
            return self.ref(a, "i")
        shape = self.shape(a)
        return self.ref(a, _flat(shape, [d if n != 1 else "0" for n, d in zip(shape, digits)]))

    def bound(self, v: ir.Value, axis: int) -> str:
        """How far a sum runs along `axis` of `v`: over a batched value's rows, the block's own
        (the last block may hold fewer); else the whole axis."""
        return "nrows" if axis == self.plan.row_axis(v) else str(self.shape(v)[axis])

    def loop(self, w: Writer, out: ir.Value):
        return w.block(f"for (int i = tid; i < {self.size(out)}; i += BLOCK) {{")

    def _broadcast_in_dim(self, w, op):
        src, out = op.inputs[0], op.outputs[0]
        dims = op.param("broadcast_dimensions")
        with self.loop(w, out):
            d = _digits(self.shape(out), "i")
            ss = self.shape(src)
            w(f"s{out.id}[i] = {self.ref(src, _flat(ss, [d[b] if ss[k] != 1 else '0' for k, b in enumerate(dims)]))};")

    def _transpose(self, w, op):
        src, out = op.inputs[0], op.outputs[0]
        perm = op.param("permutation")
        with self.loop(w, out):
            d = _digits(self.shape(out), "i")
            sd = [None] * len(perm)
            for j, p in enumerate(perm):
                sd[p] = d[j]
            w(f"s{out.id}[i] = {self.ref(src, _flat(self.shape(src), sd))};")

    def _split(self, w, op):
        src, axis = op.inputs[0], op.param("axis")
        offset = 0
        for out, n in zip(op.outputs, op.param("sizes")):
            with self.loop(w, out):
                d = _digits(self.shape(out), "i")
                d[axis] = f"({d[axis]} + {offset})" if offset else d[axis]
                w(f"s{out.id}[i] = {self.ref(src, _flat(self.shape(src), d))};")
            offset += n

    def _slice(self, w, op):
        src, out = op.inputs[0], op.outputs[0]
        start = op.param("start_indices")
        strides = op.param("strides") or (1,) * len(start)
        with self.loop(w, out):
            d = _digits(self.shape(out), "i")
            d = [f"({x} * {st} + {s0})" if (st, s0) != (1, 0) else x for x, st, s0 in zip(d, strides, start)]
            w(f"s{out.id}[i] = {self.ref(src, _flat(self.shape(src), d))};")

    def _concatenate(self, w, op):
        out, dim = op.outputs[0], op.param("dimension")
        with self.loop(w, out):
            d = _digits(self.shape(out), "i")
            w(f"const int c = {d[dim]};")
            offset, first = 0, True
            for a in op.inputs:
                n = a.shape[dim]
                dd = list(d)
                dd[dim] = f"(c - {offset})" if offset else "c"
                head = "if" if first else "else if"
                cond = f"c < {offset + n}" if a is not op.inputs[-1] else None
                line = f"s{out.id}[i] = {self.ref(a, _flat(self.shape(a), dd))};"
                w(f"{head} ({cond}) {line}" if cond else (f"else {line}" if not first else line))
                offset, first = offset + n, False

    def _dot_general(self, w, op, into: S.InPlaceSum | None = None, carry: ir.Value | None = None):
        """out = the product; with `into`, `carry` += the product (transposed by into.perm), the
        loop running over the carry's elements (each thread its own: no barrier for the carry)."""
        lhs, rhs = op.inputs
        out = op.outputs[0]
        lc, rc = S._dot_dims(op)
        ls, rs = self.shape(lhs), self.shape(rhs)
        lfree, rfree = S._free(len(ls), lc), S._free(len(rs), rc)
        dst = out if carry is None else carry
        with self.loop(w, dst):
            d = _digits(self.shape(dst), "i")
            if into is not None and into.perm is not None:  # the product's digits from the carry's
                pd = [None] * len(into.perm)
                for j, p in enumerate(into.perm):
                    pd[p] = d[j]
                d = pd
            ld, rd = [None] * len(ls), [None] * len(rs)
            for j, ax in enumerate(lfree):
                ld[ax] = d[j]
            for j, ax in enumerate(rfree):
                rd[ax] = d[len(lfree) + j]
            ctype = CTYPE[out.dtype]
            w(f"{ctype} acc = ({ctype})0;")
            for n, (a, b) in enumerate(zip(lc, rc)):
                ld[a] = rd[b] = f"k{n}"
                w(f"for (int k{n} = 0; k{n} < {self.bound(lhs, a)}; ++k{n})")
            w(f"  acc += {self.ref(lhs, _flat(ls, ld))} * {self.ref(rhs, _flat(rs, rd))};")
            w(f"s{out.id}[i] = acc;" if into is None else f"s{into.carry}[i] += acc;")

    def _reduce(self, w, op):
        src, out = op.inputs[0], op.outputs[0]
        axes = tuple(op.param("axes"))
        ss = self.shape(src)
        combine, ident = REDUCE[op.prim]
        ctype = CTYPE[out.dtype]
        with self.loop(w, out):
            d = iter(_digits(self.shape(out), "i"))
            sd = []
            for ax in range(len(ss)):
                sd.append(f"k{ax}" if ax in axes else next(d))
            w(f"{ctype} acc = {ident[ctype]};")
            for ax in axes:
                w(f"for (int k{ax} = 0; k{ax} < {self.bound(src, ax)}; ++k{ax})")
            w(f"  acc = {combine}(acc, {self.ref(src, _flat(ss, sd))});")
            w(f"s{out.id}[i] = acc;")

    _reduce_sum = _reduce_max = _reduce_min = _reduce


def _global(plan: S.ScanPlan, v: ir.Value, digits: list[str]) -> tuple[str, str | None]:
    """(offset in the global array of one step, validity condition) of a block's element: along
    its row axis (plan.row_axis) the block's rows start at row0; None: a whole value."""
    axis = plan.row_axis(v)
    if axis is None:
        return _flat(v.shape, digits), None
    d = list(digits)
    row = d[axis]
    d[axis] = f"(row0 + {row})"
    return _flat(v.shape, d), f"{row} < nrows"


def render(plan: S.ScanPlan):
    em = _Emitter(plan)
    region, m, body = plan.region, plan.mapping, plan.body
    params = [f"const {STYPE[v.dtype]}* __restrict__ in{i}" for i, v in enumerate(region.inputs)]
    params += [f"{STYPE[v.dtype]}* __restrict__ out{j}" for j, v in enumerate(region.outputs)]
    if m.cooperative:
        params.append("void* __restrict__ ws")

    arrays = _shared_arrays(plan, em)
    pro = _prologue(plan, em)
    pre = _prefetch(plan, em)

    w = Writer(2)
    for i, op in enumerate(body.ops):
        em.op(w, op, i)

    ncar = plan.num_carry
    stores = Writer(2)
    for j, y in enumerate(plan.ys):
        _store(stores, em, plan, y, region.outputs[ncar + j], j + ncar, "t")

    adv = _advance(plan, em)
    epi = _epilogue(plan, em)

    step = "LENGTH - 1 - it" if plan.reverse else "it"
    step_next = "LENGTH - 2 - it" if plan.reverse else "it + 1"
    summary = plan.description
    code = string.Template(template("scan_kernel.cu")).substitute(
        summary=summary, common=template("stitch_common.cuh"), block=m.block, rows=m.rows,
        batch=m.batch, length=m.length, name=KERNEL_NAME, params=", ".join(params),
        arrays=arrays.text(), prologue=pro.text(), step=step, step_next=step_next, prefetch=pre.text(),
        body=w.text(), stores=stores.text(), advance=adv.text(), epilogue=epi.text())
    return Source(code, KERNEL_NAME, tuple(params))


def _shared_arrays(plan: S.ScanPlan, em: _Emitter) -> Writer:
    """The kernel's pointers into dynamic shared memory, one per value the block stores."""
    arrays = Writer(1)
    stored = S.stored(dict(plan.kinds), plan.body, plan.in_place)
    offsets, _ = S.shared_layout(stored, em.size)
    for v in stored:
        ct = CTYPE[v.dtype]
        arrays(f"{ct}* s{v.id} = reinterpret_cast<{ct}*>(js_dyn + {offsets[v.id]});")
    return arrays


def _prologue(plan: S.ScanPlan, em: _Emitter) -> Writer:
    """Before the first step: every body input's initial contents in shared memory (xs: the first step's)."""
    xs_first = plan.num_consts + plan.num_carry
    pro = Writer(1)
    for k, v in enumerate(plan.body.inputs):
        src = plan.sources[k]
        if k >= xs_first:
            _load_step(pro, em, plan, v, src, "t0", f"s{v.id}[e]")
        elif em.kind(v).kind == S.PARTIAL or isinstance(src, ir.Const):
            # a sum over rows starts at 0 here (its input joins it at the end); a literal fills
            with pro.block(f"for (int e = tid; e < {em.size(v)}; e += BLOCK) {{"):
                fill = "0.0f" if em.kind(v).kind == S.PARTIAL else literal(src.value, v.dtype)
                pro(f"s{v.id}[e] = {fill};")
        else:
            _load_step(pro, em, plan, v, src, None, f"s{v.id}[e]")
    first = f"{plan.mapping.length - 1}" if plan.reverse else "0"
    pro.lines.insert(0, f"  const int t0 = {first};")
    return pro


def _prefetch(plan: S.ScanPlan, em: _Emitter) -> Writer:
    """At the top of a step: the next step's per-step inputs into registers, read while this step runs."""
    xs_first = plan.num_consts + plan.num_carry
    pre = Writer(2)
    for k, v in enumerate(plan.body.inputs[xs_first:], xs_first):
        n = -(-em.size(v) // plan.mapping.block)
        pre(f"{CTYPE[v.dtype]} pf{v.id}[{n}];")
        with pre.block("if (it + 1 < LENGTH) {"):
            with pre.block(f"for (int q = 0; q < {n}; ++q) {{"):
                pre("const int e = tid + q * BLOCK;")
                _load_step(pre, em, plan, v, plan.sources[k], "t_next", f"pf{v.id}[q]", loop=False)
    return pre


def _advance(plan: S.ScanPlan, em: _Emitter) -> Writer:
    """After a step: the carries' new values into the carries' arrays, the prefetched inputs into theirs."""
    adv = Writer(2)
    for v, out in plan.carries:
        if em.storage(out) == v.id:
            continue
        with adv.block(f"for (int e = tid; e < {em.size(v)}; e += BLOCK) {{"):
            adv(f"s{v.id}[e] = {em.ref(out, 'e')};")
    for v in plan.xs:
        n = -(-em.size(v) // plan.mapping.block)
        with adv.block("if (it + 1 < LENGTH) {"):
            with adv.block(f"for (int q = 0; q < {n}; ++q) {{"):
                adv("const int e = tid + q * BLOCK;")
                adv(f"if (e < {em.size(v)}) s{v.id}[e] = pf{v.id}[q];")
    return adv


def _epilogue(plan: S.ScanPlan, em: _Emitter) -> Writer:
    """After the last step: the final carries stored, the sums over rows combined across the blocks."""
    region = plan.region
    epi = Writer(1)
    partial = []
    for j, (v, _) in enumerate(plan.carries):
        if em.kind(v).kind == S.PARTIAL:
            partial.append((j, v))
        else:
            _store(epi, em, plan, v, region.outputs[j], j, None)
    if partial:
        _combine_partials(epi, plan, partial)
    return epi


def _combine_partials(epi: Writer, plan: S.ScanPlan, partial: list[tuple[int, ir.Value]]):
    """Each block's share of the sums over rows through the workspace, then, past one grid barrier,
    added up in block order (deterministic) onto the carries' initial values."""
    m, nc = plan.mapping, plan.num_consts
    epi("float* js_ws = reinterpret_cast<float*>(ws);")
    base = 0
    for j, v in partial:
        with epi.block(f"for (int e = tid; e < {v.size}; e += BLOCK) {{"):
            epi(f"js_ws[{base} + blockIdx.x * {v.size} + e] = s{v.id}[e];")
        base += m.grid * v.size
    epi("unsigned int js_gen = js_grid_generation();  // (no barrier opens before this block arrives)")
    epi("js_grid_sync(js_gen);")
    base = 0
    for j, v in partial:
        st = STYPE[v.dtype]
        with epi.block(f"for (int e = blockIdx.x * BLOCK + tid; e < {v.size}; e += gridDim.x * BLOCK) {{"):
            src = plan.sources[nc + j]
            init = literal(src.value, "float32") if isinstance(src, ir.Const) else f"js_io<{st}>::get(in{src}[e])"
            epi(f"float acc = {init};")
            epi(f"for (int b = 0; b < {m.grid}; ++b) acc += __ldcg(&js_ws[{base} + b * {v.size} + e]);")
            epi(f"out{j}[e] = js_io<{st}>::put(acc);")
        base += m.grid * v.size


def _load_step(w: Writer, em: _Emitter, plan: S.ScanPlan, v: ir.Value, k: int, step: str | None,
               dst: str, loop: bool = True):
    """`dst` = input k's element e (of step `step` for a per-step input), 0 past the batch."""
    n = em.size(v)
    st = STYPE[v.dtype]
    off, ok = _global(plan, v, _digits(em.shape(v), "e"))
    if step is not None:
        off = f"(long long){step} * {v.size} + {off}"
    cond = " && ".join(c for c in (None if loop else f"e < {n}", ok) if c)
    ctype = CTYPE[v.dtype]
    read = f"js_io<{st}>::get(in{k}[{off}])"
    line = f"{dst} = ({cond}) ? {read} : ({ctype})0;" if ok else (
        f"if ({cond}) {dst} = {read};" if cond else f"{dst} = {read};")
    if loop:
        with w.block(f"for (int e = tid; e < {n}; e += BLOCK) {{"):
            w(line)
    else:
        w(line)


def _store(w: Writer, em: _Emitter, plan: S.ScanPlan, y: ir.Atom, dst: ir.Value, j: int, step: str | None):
    """Result j's elements from body value `y`: its block's rows (a whole value: block 0)."""
    shape = plan.rows_shape(y)
    st = STYPE[dst.dtype]
    with w.block(f"for (int e = tid; e < {math.prod(shape)}; e += BLOCK) {{"):
        off, ok = _global(plan, y, _digits(shape, "e"))
        if step is not None:
            off = f"(long long){step} * {y.size} + {off}"
        w(f"if ({ok or 'blockIdx.x == 0'}) out{j}[{off}] = js_io<{st}>::put({em.ref(y, 'e')});")
