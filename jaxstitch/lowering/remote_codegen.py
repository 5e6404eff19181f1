"""Render a RemotePlan (plan/remote.py) as CUDA C: one code body per op structure, a case each.

A body walks its member's tile in vectors of V elements (one element at a time in the tile's
ragged end). Values that are the same for every element (scalars, broadcasts of them, ops of only
those) are computed once per block, before the walk.
"""
from __future__ import annotations

import string

from ..core import ir
from ..core import ops as opdefs
from ..graph.partition import Region
from ..plan.remote import RemotePlan
from .cuda_ops import CTYPE, EXPR, STYPE, as_written, as_xla_rounds, layout_root, literal, written_half
from .kernel import KERNEL_NAME, Unrenderable, Writer, template


class _Body:
    """Names and code of one representative region's values: `uniform` ones are one register,
    the others W-element arrays indexed by `e`."""

    def __init__(self, region: Region):
        self.region = region
        self.alias: dict[int, str] = {}
        self.uniform: set[int] = {v.id for v in region.inputs if v.size == 1}
        for op in region.ops:
            args = [a for a in op.inputs if isinstance(a, ir.Value)]
            if all(a.id in self.uniform for a in args):
                self.uniform.update(o.id for o in op.outputs)
            if opdefs.is_layout(op) and isinstance(op.inputs[0], ir.Value):
                self.alias[op.outputs[0].id] = self.name(op.inputs[0])
            elif opdefs.is_layout(op):
                self.alias[op.outputs[0].id] = literal(op.inputs[0].value, op.outputs[0].dtype)
        # Half-precision values the body also writes: read rounded, as written (cuda_ops.written_half).
        self.root = layout_root(region)
        self.rounds_written = written_half(region, {v.id for v in region.inputs}, self.root)

    def name(self, v: ir.Value) -> str:
        return self.alias.get(v.id, f"v{v.id}")

    def ref(self, a: ir.Atom, stored: bool = False) -> str:
        """`a`'s element `e` (a uniform value's register); a half-precision value the body writes is
        read rounded, except by its store (`stored`)."""
        if isinstance(a, ir.Const):
            return literal(a.value, a.dtype)
        expr = self.name(a) if a.id in self.uniform else f"{self.name(a)}[e]"
        return expr if stored else as_written(self.rounds_written, self.root(a.id), expr)

    def compute_ops(self):
        return [op for op in self.region.ops if not opdefs.is_layout(op)]

    def prologue(self, w: Writer):
        """Pointers, scalar inputs and the block-uniform values."""
        r = self.region
        for i, v in enumerate(r.inputs):
            w(f"const {STYPE[v.dtype]}* __restrict__ in{i} = (const {STYPE[v.dtype]}*)P.p[buf[{i}]];")
        for j, v in enumerate(r.outputs):
            w(f"{STYPE[v.dtype]}* __restrict__ out{j} = ({STYPE[v.dtype]}*)P.p[buf[{len(r.inputs) + j}]];")
        for i, v in enumerate(r.inputs):
            if v.size == 1:
                w(f"const {CTYPE[v.dtype]} v{v.id} = js_io<{STYPE[v.dtype]}>::get(in{i}[0]);")
        for op in self.compute_ops():
            if op.outputs[0].id in self.uniform:
                w(f"const {CTYPE[op.outputs[0].dtype]} v{op.outputs[0].id} = {self.expr(op)};")

    def expr(self, op: ir.Op) -> str:
        if op.prim not in EXPR or len(op.outputs) != 1:
            raise Unrenderable(f"{op.prim} has no C expression")
        return as_xla_rounds(op, EXPR[op.prim](op, [self.ref(a) for a in op.inputs]), self.region.shared)

    def elements(self, w: Writer, width: str, at: str):
        """The member's work on elements [at, at + width)."""
        r = self.region
        for i, v in enumerate(r.inputs):
            if v.size > 1:
                w(f"{CTYPE[v.dtype]} v{v.id}[{width}];")
                w(f"js_load<{STYPE[v.dtype]}, {width}>(in{i} + {at}, v{v.id});")
        for op in self.compute_ops():
            out = op.outputs[0]
            if out.id in self.uniform:
                continue
            w(f"{CTYPE[out.dtype]} v{out.id}[{width}];")
            w("#pragma unroll")
            w(f"for (int e = 0; e < {width}; ++e) v{out.id}[e] = {self.expr(op)};")
        for j, v in enumerate(r.outputs):
            w(f"{CTYPE[v.dtype]} t{j}[{width}];")
            w("#pragma unroll")
            w(f"for (int e = 0; e < {width}; ++e) t{j}[e] = {self.ref(v, stored=True)};")
            w(f"js_store<{STYPE[v.dtype]}, {width}>(out{j} + {at}, t{j});")


def _case(index: int, region: Region) -> str:
    body = _Body(region)
    w = Writer(2)
    with w.block(f"case {index}: {{"):
        w(f"const unsigned short* buf = js_buf{index}[js_slot[m]];")
        body.prologue(w)
        with w.block("for (long long i = start + (long long)threadIdx.x * V; i < end; i += (long long)BLOCK * V) {"):
            with w.block("if (i + V <= end) {"):
                body.elements(w, "V", "i")
            with w.block("else for (long long j = i; j < end; ++j) {  // the member's ragged end"):
                body.elements(w, "1", "j")
        w("break;")
    return w.text()


def render(plan: RemotePlan) -> str:
    m = plan.mapping
    members = plan.members
    tables = []
    for b in range(len(plan.bodies)):
        rows = [mb.buffers for mb in members if mb.body == b]
        cells = ", ".join("{" + ", ".join(map(str, row)) + "}" for row in rows)
        tables.append(f"__constant__ unsigned short js_buf{b}[{len(rows)}][{len(rows[0])}] = {{{cells}}};")
    n_buffers = len(plan.region.inputs) + len(plan.region.outputs)
    return string.Template(template("remote_kernel.cu")).substitute(
        summary=f"{len(members)} chains, {len(plan.bodies)} code bodies",
        common=template("stitch_common.cuh"),
        block=m.block, vec=m.vec, tile=m.tile, members=len(members), n_buffers=n_buffers,
        first_tasks=", ".join(f"{mb.first_task}LL" for mb in members) + f", {m.grid}LL",
        sizes=", ".join(f"{mb.size}LL" for mb in members),
        bodies=", ".join(str(mb.body) for mb in members),
        slots=", ".join(str(mb.slot) for mb in members),
        tables="\n".join(tables),
        name=KERNEL_NAME,
        cases="\n".join(_case(b, rep) for b, rep in enumerate(plan.bodies)))
