"""Render a KernelPlan as CUDA C: the plan decides, the template in csrc_templates/ holds the hooks.

Values are named `v<id>`. A value stored per element (full or column storage) is an array of E
registers indexed by the thread's element slot; a row or scalar value is one register. Layout ops
emit nothing: their result is another name for the operand.
"""
from __future__ import annotations

import dataclasses
import functools
import string
from importlib import resources

from .. import ir, ops as opdefs
from ..plan import KernelPlan
from ..plan.layout import COL, EPILOGUE, FULL, ROW, SCALAR, Unplannable
from .cuda_ops import ARG_REDUCE, CTYPE, EXPR, REDUCE, STYPE, literal

KERNEL_NAME = "jaxstitch_kernel"


@functools.lru_cache(maxsize=None)
def template(name: str) -> str:
    return resources.files("jaxstitch.csrc_templates").joinpath(name).read_text()


def vec_col(k: str) -> str:
    """The first column of this thread's vector `k` in chunk `ch` (vectors of V, TPR threads a row)."""
    return f"((ch * VPT + {k}) * TPR + lane) * V"


def col_index(e: str) -> str:
    """The column (of the whole row) of this thread's element slot `e` in chunk `ch`."""
    return f"(ROW_C0 + {vec_col(f'({e}) / V')} + ({e}) % V)"


def stash_slot(ptr: str) -> str:
    """This thread's vector `k` of chunk `ch` in a stash buffer at `ptr`: slots interleave the block's
    threads, so a warp's 16-byte accesses are contiguous."""
    return f"{ptr} + ((ch * VPT + k) * BLOCK + tid) * V"


@dataclasses.dataclass(frozen=True)
class Source:
    code: str
    name: str
    param_names: tuple[str, ...]


class _Writer:
    def __init__(self, indent: int):
        self.lines: list[str] = []
        self.indent = indent

    def __call__(self, line: str = ""):
        self.lines.append("  " * self.indent + line)

    def text(self) -> str:
        return "\n".join(self.lines)


class _Kernel:
    def __init__(self, plan: KernelPlan):
        self.plan = plan
        self.layout = plan.layout
        self.m = plan.mapping
        self.alias: dict[int, int] = {}
        self.inputs = {v.id: i for i, v in enumerate(plan.region.inputs)}
        self.outputs = list(plan.region.outputs)
        self.split = self.m.splits > 1
        self.exact_cols = (self.m.chunks * self.m.vpt * self.m.tpr * self.m.vec == self.m.slice_cols
                           and self.m.slice_cols * self.m.splits == self.m.n_cols)
        # A split row's slice changes with the block's task: it is walked as a chunked row is.
        self.chunked = self.m.chunks > 1 or self.split
        # Per-chunk kinds: what a thread holds as E-element arrays, made again for every chunk of a row.
        self.per_chunk = (FULL, COL) if self.chunked else (FULL,)
        self.n_row_red = 0
        # The js_red bank pairs of the row loop's reduction rounds, round r using bank r % 2: a bank
        # is written again two rounds later, after the other round's barrier, so a round needs no
        # barrier after its reads, except the last one of an odd count (see _drop_reuse_barriers).
        self.red_rounds: list[tuple[_Writer, int]] = []
        # Rematerialization: a full-size value is kept in registers only within the phase that made
        # it; a later phase recomputes it from the loaded inputs, so the registers held across the
        # row reductions are just the inputs' (memory-bound kernels have ALU to spare).
        self.phase: int | None = None
        self.writer: _Writer | None = None
        self.def_op: dict[int, ir.Op] = {}
        self.def_phase: dict[int, int] = {}
        self.copies: dict[tuple[int, int], str] = {}
        # Values that are a float rounded to a half type: stored from the float itself, since the
        # store rounds it the same way (one rounding instead of two).
        self.rounded_from: dict[int, ir.Atom] = {}

    # ---- naming -------------------------------------------------------------------------------
    def root(self, vid: int) -> int:
        while vid in self.alias:
            vid = self.alias[vid]
        return vid

    def placed(self, v: ir.Value):
        return self.layout.of(v)

    def is_array(self, v: ir.Value) -> bool:
        return self.placed(v).storage in (FULL, COL) and self.placed(v).level != EPILOGUE

    def ref(self, a: ir.Atom, e: str = "e") -> str:
        if isinstance(a, ir.Const):
            return literal(a.value, a.dtype)
        root = self.root(a.id)
        name = f"v{root}"
        if self.phase is not None and self.def_phase.get(root, self.phase) != self.phase:
            name = self.rematerialize(root)
        return f"{name}[{e}]" if self.is_array(a) else name

    def rematerialize(self, root: int) -> str:
        key = (root, self.phase)
        if key not in self.copies:
            name = f"v{root}_p{self.phase}"
            op = self.def_op[root]
            (self.iota if op.prim == "iota" else self.elementwise)(self.writer, op, name)
            self.copies[key] = name
        return self.copies[key]

    def remember(self, op: ir.Op):
        """An array made in this phase: later phases recompute it (see rematerialize)."""
        out = op.outputs[0]
        if self.phase is not None and self.is_array(out):
            self.def_op[out.id], self.def_phase[out.id] = op, self.phase

    def ctype(self, v: ir.Value) -> str:
        return CTYPE[v.dtype]

    def col_ok(self, e: str = "e") -> str:
        if self.exact_cols:
            return "true"
        return f"({vec_col(f'({e}) / V')} < ROW_COLS)"  # V divides N_COLS and SLICE

    # ---- ops --------------------------------------------------------------------------------------
    def elementwise(self, w: _Writer, op: ir.Op, name: str | None = None):
        out = op.outputs[0]
        if name is None:
            name = f"v{out.id}"
            self.remember(op)
        args = [self.ref(a) for a in op.inputs]
        if (op.prim == "div" and self.is_array(out) and self.ctype(out) == "float"
                and not (isinstance(op.inputs[1], ir.Value) and self.is_array(op.inputs[1]))):
            # One divisor for the whole row: its reciprocal once (js_div_by rounds as js_div does).
            expr = f"js_div_by({args[0]}, {args[1]})"
        else:
            expr = EXPR[op.prim](op, args)
        if (op.prim == "convert_element_type" and out.dtype in ("bfloat16", "float16")
                and CTYPE[op.inputs[0].dtype] == "float"):
            self.rounded_from[out.id] = op.inputs[0]
        if self.is_array(out):
            w(f"{self.ctype(out)} {name}[E];")
            w("#pragma unroll")
            w(f"for (int e = 0; e < E; ++e) {name}[e] = {expr};")
        else:
            w(f"const {self.ctype(out)} {name} = {expr};")

    def iota(self, w: _Writer, op: ir.Op, name: str | None = None):
        out = op.outputs[0]
        if name is None:
            name = f"v{out.id}"
            self.remember(op)
        stride, size = self.placed(out).iota
        if self.placed(out).storage == ROW:
            w(f"const int {name} = (int)((row / {stride}) % {size});")
        elif self.placed(out).storage == COL:
            expr = col_index("e") + (f" / {stride}" if stride > 1 else "")
            if stride * size < self.m.n_cols:  # else the quotient is below `size` already
                expr += f" % {size}"
            w(f"int {name}[E];")
            w("#pragma unroll")
            w(f"for (int e = 0; e < E; ++e) {name}[e] = {expr};")
        else:
            w(f"const int {name} = 0;")

    def emit_op(self, w: _Writer, op: ir.Op):
        if opdefs.is_layout(op) and isinstance(op.inputs[0], ir.Const):
            out = op.outputs[0]
            w(f"const {self.ctype(out)} v{out.id} = {literal(op.inputs[0].value, out.dtype)};")
        elif opdefs.is_layout(op):
            self.alias[op.outputs[0].id] = self.root(op.inputs[0].id)
        elif op.prim == "iota":
            self.iota(w, op)
        else:
            self.elementwise(w, op)

    # ---- memory -----------------------------------------------------------------------------------
    def load_array(self, w: _Writer, v: ir.Value, ptr: str, per_row: bool, stash: str | None = None,
                   from_stash: bool = False):
        """E elements of `v` owned by this thread (of the current chunk): of the current row, or of the
        column vector. `stash` names this input's shared-memory stash: the first phase copies the
        loaded vectors there, later phases read them back (each thread only its own slots)."""
        ct, st = self.ctype(v), STYPE[v.dtype]
        slot = stash_slot(stash) if stash else None
        w(f"{ct} v{v.id}[E];")
        w("#pragma unroll")
        w("for (int k = 0; k < VPT; ++k) {")
        w(f"  const int col0 = {vec_col('k')};")
        guard = f"{'row_ok && ' if per_row else ''}col0 < ROW_COLS"
        if stash is None:
            w(f"  if ({guard}) js_load<{st}, V>({ptr} + col0, &v{v.id}[k * V]);")
        elif from_stash:
            w(f"  if ({guard}) js_load<{st}, V>({slot}, &v{v.id}[k * V]);")
        else:
            w(f"  if ({guard}) js_load_stash<{st}, V>({ptr} + col0, {slot}, &v{v.id}[k * V]);")
        w(f"  else for (int i = 0; i < V; ++i) v{v.id}[k * V + i] = ({ct})0;")
        w("}")

    def store_array(self, w: _Writer, v: ir.Value, out_index: int, guard: str, base: str):
        st = STYPE[v.dtype]
        w("#pragma unroll")
        w("for (int k = 0; k < VPT; ++k) {")
        w(f"  const int col0 = {vec_col('k')};")
        w(f"  if ({guard}col0 < ROW_COLS) {{")
        src = self.rounded_from.get(self.root(v.id), v)
        w(f"    {self.ctype(src)} t[V];")
        w("    for (int i = 0; i < V; ++i) { const int e = k * V + i; t[i] = " + self.ref(src) + "; }")
        w(f"    js_store<{st}, V>(out{out_index} + {base}col0, t);")
        w("  }")
        w("}")

    def store_output(self, w: _Writer, v: ir.Value, where: str):
        """Store `v` if it is a region output, once, where its value exists: full values per chunk of
        the row ("chunk"), row values per row ("row"), column and scalar values before the row loop by
        block 0 ("prologue"; column values of a chunked row are made per chunk, so block 0 stores
        them in its first row's chunks)."""
        for j, o in enumerate(self.outputs):
            if o.id != v.id:
                continue
            p = self.placed(o)
            st = STYPE[o.dtype]
            if where == "chunk" and p.declared == FULL:
                self.store_array(w, o, j, "row_ok && ", "row * N_COLS + ROW_C0 + ")
            elif where == "row" and p.declared == ROW:
                w(f"if (row_ok && lane == 0 && ROW_C0 == 0) out{j}[row] = js_io<{st}>::put({self.ref(o, '0')});")
            elif p.declared == COL and (where, self.chunked and p.storage == COL) in (("prologue", False), ("chunk", True)):
                if where == "chunk":  # the row-0 tasks (every slice of row 0)
                    w("if (row == 0) {")
                    self.store_array(w, o, j, "", "ROW_C0 + ")
                else:
                    w("if (blockIdx.x == 0 && row_in_block == 0) {")
                    self.store_array(w, o, j, "", "")
                w("}")
            elif where == "prologue" and p.declared == SCALAR:
                w(f"if (blockIdx.x == 0 && tid == 0) out{j}[0] = js_io<{st}>::put({self.ref(o, '0')});")

    # ---- reductions -------------------------------------------------------------------------------
    def reduce_init(self, w: _Writer, ops: list[ir.Op]):
        """Per-thread partials of the row reductions finishing in this phase."""
        for op in ops:
            o = op.outputs[0]
            if op.prim in ARG_REDUCE:
                kind = "reduce_max" if ARG_REDUCE[op.prim] == "true" else "reduce_min"
                w(f"float p{o.id} = {REDUCE[kind][1]['float']}; int q{o.id} = 0x7fffffff;")
            else:
                w(f"{self.ctype(o)} p{o.id} = {REDUCE[op.prim][1][self.ctype(o)]};")

    def reduce_accumulate(self, w: _Writer, ops: list[ir.Op]):
        """Fold this thread's elements (of the current chunk) into its partials."""
        for op in ops:
            src, o = op.inputs[0], op.outputs[0]
            w("#pragma unroll")
            if op.prim in ARG_REDUCE:
                w(f"for (int e = 0; e < E; ++e) if ({self.col_ok()}) js_arg_combine<{ARG_REDUCE[op.prim]}>"
                  f"(p{o.id}, q{o.id}, (float){self.ref(src)}, {col_index('e')});")
            else:
                fn, ct = REDUCE[op.prim][0], self.ctype(o)
                w(f"for (int e = 0; e < E; ++e) if ({self.col_ok()}) p{o.id} = {fn}(p{o.id}, ({ct}){self.ref(src)});")

    def reduce_finish(self, w: _Writer, ops: list[ir.Op]):
        """Combine the partials across the row's threads: shuffles, then (rows wider than a warp) one
        round through shared memory for the whole batch of reductions (one barrier pair)."""
        if not ops:
            return
        slots = []
        for op in ops:
            o = op.outputs[0]
            kind = "arg" if op.prim in ARG_REDUCE else self.ctype(o)
            if self.m.tpr > 1 and kind == "arg":
                w(f"js_group_arg_reduce<{min(self.m.tpr, 32)}, {ARG_REDUCE[op.prim]}>(p{o.id}, q{o.id});")
            elif self.m.tpr > 1:
                w(f"p{o.id} = js_group_reduce<{min(self.m.tpr, 32)}>(p{o.id}, {REDUCE[op.prim][0]});")
            slots.append((op, kind))
        if self.m.tpr > 32:
            self.n_row_red = max(self.n_row_red, len(slots))
            bank = len(self.red_rounds) % 2
            w("if ((tid & 31) == 0) {")
            for i, (op, kind) in enumerate(slots):
                o = op.outputs[0].id
                if kind == "arg":
                    w(f"  js_red[{bank}][{i}][row_in_block][lane >> 5] = p{o}; js_redi[{bank}][{i}][row_in_block][lane >> 5] = q{o};")
                elif kind == "int":
                    w(f"  js_redi[{bank}][{i}][row_in_block][lane >> 5] = p{o};")
                else:
                    w(f"  js_red[{bank}][{i}][row_in_block][lane >> 5] = (float)p{o};")
            w("}")
            w("__syncthreads();")
            for i, (op, kind) in enumerate(slots):
                o = op.outputs[0].id
                if kind == "arg":
                    w(f"p{o} = js_red[{bank}][{i}][row_in_block][0]; q{o} = js_redi[{bank}][{i}][row_in_block][0];")
                    w(f"for (int j = 1; j < NWARPS_ROW; ++j) js_arg_combine<{ARG_REDUCE[op.prim]}>(p{o}, q{o}, js_red[{bank}][{i}][row_in_block][j], js_redi[{bank}][{i}][row_in_block][j]);")
                else:
                    fn = REDUCE[op.prim][0]
                    arr = "js_redi" if kind == "int" else "js_red"
                    w(f"p{o} = {arr}[{bank}][{i}][row_in_block][0];")
                    w(f"for (int j = 1; j < NWARPS_ROW; ++j) p{o} = {fn}(p{o}, ({kind}){arr}[{bank}][{i}][row_in_block][j]);")
            self.red_rounds.append((w, len(w.lines)))
            w("__syncthreads();  // before js_red's bank is written again")
        if self.split:
            self.combine_slices(w, slots)
        for op, kind in slots:
            o = op.outputs[0]
            w(f"const {self.ctype(o)} v{o.id} = {'q' if kind == 'arg' else 'p'}{o.id};")

    def combine_slices(self, w: _Writer, slots):
        """A split row: each block has reduced its slice; the slices' partials meet in the workspace,
        past a grid barrier, and every block of the row combines them in slice order."""
        offsets = {g.value_id: g.offset for g in self.plan.split_partials}
        w("if (tid == 0 && row_ok) {")
        for op, kind in slots:
            o = op.outputs[0].id
            val = f"__int_as_float(p{o})" if kind == "int" else f"(float)p{o}"
            w(f"  js_ws[{offsets[o]} + row * SPLITS + js_slice] = {val};")
        w("}")
        w("js_grid_sync(reinterpret_cast<unsigned int*>(ws) + 1, ++js_round * gridDim.x);")
        w("if (row_ok) {")
        for op, kind in slots:
            o, fn = op.outputs[0].id, REDUCE[op.prim][0]
            at = f"js_ws + {offsets[o]} + row * SPLITS"
            get = (lambda i: f"__float_as_int(__ldcg({at} + {i}))") if kind == "int" else (lambda i: f"__ldcg({at} + {i})")
            w(f"  p{o} = {get(0)};")
            w(f"  for (int s = 1; s < SPLITS; ++s) p{o} = {fn}(p{o}, {get('s')});")
        w("}")

    def grid_accumulate(self, w: _Writer, op: ir.Op):
        src, out = op.inputs[0], op.outputs[0]
        fn = REDUCE[op.prim][0]
        if self.placed(out).declared == COL:
            w("#pragma unroll")
            w(f"for (int e = 0; e < E; ++e) if (row_ok && {self.col_ok()}) a{out.id}[e] = {fn}(a{out.id}[e], (float){self.ref(src)});")
        elif self.placed(src).declared == FULL:
            w("#pragma unroll")
            w(f"for (int e = 0; e < E; ++e) if (row_ok && {self.col_ok()}) a{out.id} = {fn}(a{out.id}, (float){self.ref(src)});")
        else:
            w(f"if (row_ok && lane == 0 && ROW_C0 == 0) a{out.id} = {fn}(a{out.id}, (float){self.ref(src, '0')});")


@dataclasses.dataclass(frozen=True)
class _Phase:
    """What one phase of the row loop (between two rounds of row reductions) does."""

    level: int
    made: tuple[ir.Op, ...]            # ops whose result belongs to this phase
    reductions: tuple[ir.Op, ...]      # row reductions folding this phase's values
    grids: tuple[ir.Op, ...]           # grid reductions accumulating this phase's values
    per_elem_grids: tuple[ir.Op, ...]  # ... of those, the ones accumulating per element
    stored: tuple[ir.Value, ...]       # values this phase's code defines (stored if outputs)
    chunk_work: bool                   # touches the row's elements: needs a pass over the chunks


def _phases(k: _Kernel, body_ops, grid_ops, level: dict) -> list[_Phase]:
    layout = k.layout
    phases = []
    for lv in range(max([level[o.outputs[0].id] for o in body_ops] + [0]) + 1):
        made = tuple(op for op in body_ops if not _is_row_reduction(op) and not opdefs.is_grid_reduction(op)
                     and level[op.outputs[0].id] == lv)
        reds = tuple(op for op in body_ops if _is_row_reduction(op) and level[op.inputs[0].id] == lv)
        grids = tuple(op for op in grid_ops if level[op.inputs[0].id] == lv)
        per_elem_grids = tuple(op for op in grids if layout.of(op.inputs[0]).declared == FULL
                               or layout.of(op.outputs[0]).declared == COL)
        stored = tuple(op.outputs[0] for op in body_ops if _defined_at(op, level) == lv)
        chunk_work = bool(lv == 0 or reds or per_elem_grids
                          or any(layout.of(op.outputs[0]).storage in k.per_chunk for op in made)
                          or any(v in k.outputs and layout.of(v).declared in (FULL, COL) for v in stored))
        phases.append(_Phase(lv, made, reds, grids, per_elem_grids, stored, chunk_work))
    return phases


def _is_row_reduction(op: ir.Op) -> bool:
    return op.prim in opdefs.REDUCTIONS and not opdefs.is_layout(op) and not opdefs.is_grid_reduction(op)


def _defined_at(op: ir.Op, level: dict) -> int:
    """The phase whose code defines op's output: a row reduction finishes in its operand's phase."""
    return level[op.inputs[0].id] if _is_row_reduction(op) else level[op.outputs[0].id]


def render(plan: KernelPlan) -> Source:
    k = _Kernel(plan)
    region, layout, m = plan.region, plan.layout, plan.mapping
    level = {p.value.id: p.level for p in layout.values}
    grid_ops = [op for op in region.ops if opdefs.is_grid_reduction(op)]
    for op in grid_ops:
        if CTYPE[op.outputs[0].dtype] != "float":
            raise Unplannable(f"{op.prim} over the grid of a {op.outputs[0].dtype} value")
    per_chunk = k.per_chunk

    params = [f"const {STYPE[v.dtype]}* __restrict__ in{i}" for i, v in enumerate(region.inputs)]
    params += [f"{STYPE[v.dtype]}* __restrict__ out{j}" for j, v in enumerate(region.outputs)]
    if m.cooperative:
        params.append("void* __restrict__ ws")

    pro, body, epi = _Writer(1), _Writer(2), _Writer(1)
    # Prologue: scalars and column values, the same for every row this thread visits.
    pro("const int ch = 0;  // the chunk, for code outside chunk loops")
    if m.cooperative:
        pro("float* js_ws = reinterpret_cast<float*>(ws);")
    if k.split:
        pro("unsigned int js_round = 0;  // grid barriers crossed (combine_slices)")
        # Rounds of whole rows: a row's slices must meet at the same barriers, so each round runs
        # gridDim.x / SPLITS rows (the planner keeps SPLITS <= the SMs, so at least one fits).
        pro("const long long js_step = (long long)(gridDim.x / SPLITS) * SPLITS;")
        pro("if (js_step == 0) __trap();  // fewer blocks than slices: fail loudly, never a wrong result")
    for v in region.inputs:
        p, i = layout.of(v), k.inputs[v.id]
        if p.storage == SCALAR:
            pro(f"const {k.ctype(v)} v{v.id} = js_io<{STYPE[v.dtype]}>::get(in{i}[0]);")
        elif p.storage == COL and not k.chunked:
            k.load_array(pro, v, f"in{i}", per_row=False)
    body_ops, epi_ops = [], []
    early = list(region.inputs)  # values that exist before the row loop's phases
    for op in region.ops:
        p = layout.of(op.outputs[0])
        if p.level == EPILOGUE:
            epi_ops.append(op)
        elif p.storage in (SCALAR, COL) and p.storage not in per_chunk and (
                op.prim not in opdefs.REDUCTIONS or opdefs.is_layout(op)):
            k.emit_op(pro, op)
            early.append(op.outputs[0])
        else:
            body_ops.append(op)
    for v in early:
        k.store_output(pro, v, "prologue")
    for op in grid_ops:
        out = op.outputs[0]
        ident = REDUCE[op.prim][1]["float"]
        if layout.of(out).declared == COL:
            pro(f"float a{out.id}[E];")
            pro(f"for (int e = 0; e < E; ++e) a{out.id}[e] = {ident};")
        else:
            pro(f"float a{out.id} = {ident};")

    # Body: one row per row group; phases separated by the row reductions.
    stash = {s.value_id: s.offset for s in plan.stash}
    k.writer = body
    if m.stages:  # the first row group's copies start before the loop; see mapping.py
        pro("int js_buf = 0;")
        _stage_rows(k, pro, stash, "(long long)blockIdx.x" if k.split else "(long long)blockIdx.x * RPB")
    if m.stages == 2:  # refill the other buffer (read by the last row group: all its reads are done)
        body("__syncthreads();")
        body("js_buf ^= 1;")
        _stage_rows(k, body, stash, "base + js_step" if k.split else "base + (long long)gridDim.x * RPB")
        body("js_buf ^= 1;  // back to this row group's buffer; the loop's end moves on to the next")
        body("js_stage_wait<1>();")
    elif m.stages == 1:
        body("js_stage_wait<0>();")
    for v in region.inputs:
        p, i = layout.of(v), k.inputs[v.id]
        if p.storage == ROW:
            body(f"const {k.ctype(v)} v{v.id} = row_ok ? js_io<{STYPE[v.dtype]}>::get(in{i}[row]) : ({k.ctype(v)})0;")
    if not k.chunked:
        _load_chunk(k, body, stash, first_phase=True)
    for v in early:
        k.store_output(body, v, "row")
    phases = _phases(k, body_ops, grid_ops, level)
    last_chunk_phase = max(ph.level for ph in phases if ph.chunk_work)
    for ph in phases:
        lv = k.phase = ph.level
        # Row values first (outside any chunk loop), then the per-element work, chunk by chunk.
        for op in ph.made:
            if layout.of(op.outputs[0]).storage not in per_chunk:
                k.emit_op(body, op)
        k.reduce_init(body, ph.reductions)
        w = body
        if k.chunked and ph.chunk_work:
            body("for (int ch = 0; ch < CHUNKS; ++ch) {")
            w = k.writer = _Writer(body.indent + 1)
            _load_chunk(k, w, stash, first_phase=lv == 0)
        if lv == 0:
            for v in early:
                k.store_output(w, v, "chunk")
        for op in ph.made:
            if layout.of(op.outputs[0]).storage in per_chunk:
                k.emit_op(w, op)
        k.reduce_accumulate(w, ph.reductions)
        for v in ph.stored:
            k.store_output(w, v, "chunk")
        for op in ph.per_elem_grids:
            k.grid_accumulate(w, op)
        if k.chunked and ph.chunk_work:
            body.lines.extend(w.lines)
            body("}")
            k.writer = body
        if m.stages == 1 and lv == last_chunk_phase:  # the stash is read for the last time: refill it
            body("__syncthreads();")
            _stage_rows(k, body, stash, "base + js_step" if k.split else "base + (long long)gridDim.x * RPB")
        k.reduce_finish(body, ph.reductions)
        for v in ph.stored:
            k.store_output(body, v, "row")
        for op in ph.grids:
            if op not in ph.per_elem_grids:
                k.grid_accumulate(body, op)
    if m.stages == 2:
        body("js_buf ^= 1;")
    _drop_reuse_barriers(k, loop_top_barrier=m.stages == 2)

    k.phase = None
    shared = _Writer(1)
    if m.tpr > 32 and k.n_row_red:
        shared(f"__shared__ float js_red[2][{k.n_row_red}][RPB][NWARPS_ROW];")
        shared(f"__shared__ int js_redi[2][{k.n_row_red}][RPB][NWARPS_ROW];")
    if m.smem_bytes:
        shared("extern __shared__ __align__(16) unsigned char js_dyn[];")
    if grid_ops:
        _epilogue(k, epi, shared, grid_ops, epi_ops)

    if k.split:  # one task per (row, slice); every block runs the same number of rounds (grid barriers)
        loop_head = "\n".join([
            "  for (long long base = blockIdx.x; base - blockIdx.x < N_TASKS; base += js_step) {",
            "    const long long row = base / SPLITS;",
            "    const int js_slice = (int)(base % SPLITS);",
            "    const int js_c0 = js_slice * SLICE, js_ncols = min(SLICE, N_COLS - js_c0);",
            "    const bool row_ok = blockIdx.x < js_step && base < N_TASKS;"])
    else:
        loop_head = "\n".join([
            "  for (long long base = (long long)blockIdx.x * RPB; base < N_ROWS; base += (long long)gridDim.x * RPB) {",
            "    const long long row = base + row_in_block;",
            "    const bool row_ok = row < N_ROWS;"])
    summary = f"{len(region.ops)} ops, {m.n_rows}x{m.n_cols}, {m.name}, scheme {plan.scheme}"
    code = string.Template(template("stitch_kernel.cu")).substitute(
        summary=summary, common=template("stitch_common.cuh"), n_rows=m.n_rows, n_cols=m.n_cols,
        vec=m.vec, tpr=m.tpr, vpt=m.vpt, chunks=m.chunks, rows_per_block=m.rows_per_block, block=m.block,
        min_blocks=m.min_blocks, splits=m.splits, slice=m.slice_cols,
        row_c0="js_c0" if k.split else "0", row_cols="js_ncols" if k.split else "N_COLS", loop_head=loop_head,
        name=KERNEL_NAME, params=", ".join(params), shared=shared.text(), prologue=pro.text(),
        body=body.text(), epilogue=epi.text())
    return Source(code, KERNEL_NAME, tuple(params))


def _drop_reuse_barriers(k: _Kernel, loop_top_barrier: bool):
    """Removes the barriers after reduction rounds whose bank the next writer reaches only past
    another barrier: every round's but the last, and the last's too when the rounds per row are even
    (the next row's first round uses the other bank) or the row loop starts with a barrier."""
    n = len(k.red_rounds)
    for r, (w, at) in enumerate(k.red_rounds):
        if r < n - 1 or n % 2 == 0 or loop_top_barrier:
            w.lines[at] = None
    for w in {id(w): w for w, _ in k.red_rounds}.values():
        w.lines[:] = [line for line in w.lines if line is not None]


def _stash_ptr(k: _Kernel, v: ir.Value, offset: int) -> str:
    buf = f"js_buf * {k.plan.stage_bytes} + " if k.m.stages == 2 else ""
    return f"reinterpret_cast<{STYPE[v.dtype]}*>(js_dyn + {buf}{offset})"


def _load_chunk(k: _Kernel, w: _Writer, stash: dict[int, int], first_phase: bool):
    """This thread's elements of the per-chunk inputs: row inputs from the stash when they were staged
    into it, else from global memory in the first phase (copied to the stash when there is one) and
    from the stash after; column inputs (chunked rows only) from global memory, where L1/L2 keep them."""
    for v in k.plan.region.inputs:
        p, i = k.layout.of(v), k.inputs[v.id]
        if p.storage == FULL:
            ptr = f"in{i} + row * N_COLS + ROW_C0"
            if v.id in stash:
                k.load_array(w, v, ptr, per_row=True, stash=_stash_ptr(k, v, stash[v.id]),
                             from_stash=k.m.stages > 0 or not first_phase)
            else:
                k.load_array(w, v, ptr, per_row=True)
        elif p.storage == COL and k.chunked:
            k.load_array(w, v, f"in{i} + ROW_C0", per_row=False)


def _stage_rows(k: _Kernel, w: _Writer, stash: dict[int, int], base: str):
    """Start async copies of the row group at `base` into the stash buffer `js_buf` (this thread's
    slots, every chunk) and commit them as one group."""
    w("{")
    if k.split:  # `base` is a task: a slice of a row
        w(f"  const long long stask = {base};")
        w("  const long long srow = stask / SPLITS;")
        w("  const int sc0 = (int)(stask % SPLITS) * SLICE, scols = min(SLICE, N_COLS - sc0);")
        w("  const bool sok = stask < N_TASKS && blockIdx.x < js_step;")
    else:
        w(f"  const long long srow = {base} + row_in_block;")
        w("  const int sc0 = 0, scols = N_COLS;")
        w("  const bool sok = srow < N_ROWS;")
    w("  for (int ch = 0; ch < CHUNKS; ++ch) {")
    w("#pragma unroll")
    w("    for (int k = 0; k < VPT; ++k) {")
    w(f"      const int col0 = {vec_col('k')};")
    w("      const bool ok = sok && col0 < scols;")
    for v in k.plan.region.inputs:
        if v.id in stash:
            i = k.inputs[v.id]
            w(f"      js_stage<{STYPE[v.dtype]}, V>({stash_slot(_stash_ptr(k, v, stash[v.id]))}, "
              f"ok ? in{i} + srow * N_COLS + sc0 + col0 : in{i}, ok);")
    w("    }")
    w("  }")
    w("  js_stage_commit();")
    w("}")


COL_GROUP = 8  # columns a block finishes together: one 32-byte sector of a row of float partials


def _epilogue(k: _Kernel, w: _Writer, shared: _Writer, grid_ops, epi_ops):
    """Grid-wide reductions: block partials to the workspace, one barrier, then every block finishes
    a slice of the columns (and every block the scalars), summing partials in a fixed order."""
    layout, m = k.layout, k.plan.mapping
    offsets = {g.value_id: g.offset for g in k.plan.grid_reductions}
    shared("__shared__ float js_scr[BLOCK / 32];")
    if m.rows_per_block > 1 and any(layout.of(op.outputs[0]).declared == COL for op in grid_ops):
        shared("__shared__ float js_colbuf[N_COLS];")
    for op in grid_ops:
        o, fn = op.outputs[0].id, REDUCE[op.prim][0]
        off = offsets[o]
        if layout.of(op.outputs[0]).declared == COL:
            if m.rows_per_block == 1:
                w("#pragma unroll")
                w(f"for (int e = 0; e < E; ++e) {{ const int c = " + col_index("e") + "; "
                  f"if (c < N_COLS) js_ws[{off} + (long long)blockIdx.x * N_COLS + c] = a{o}[e]; }}")
            else:
                w("for (int rg = 0; rg < RPB; ++rg) {")
                w("  if (row_in_block == rg) {")
                w("#pragma unroll")
                w(f"    for (int e = 0; e < E; ++e) {{ const int c = " + col_index("e") + "; "
                  f"if (c < N_COLS) js_colbuf[c] = rg == 0 ? a{o}[e] : {fn}(js_colbuf[c], a{o}[e]); }}")
                w("  }")
                w("  __syncthreads();")
                w("}")
                w(f"for (int c = tid; c < N_COLS; c += BLOCK) js_ws[{off} + (long long)blockIdx.x * N_COLS + c] = js_colbuf[c];")
                w("__syncthreads();")
        else:
            w("{")
            w(f"  float t = js_group_reduce<32>(a{o}, {fn});")
            w("  if ((tid & 31) == 0) js_scr[tid >> 5] = t;")
            w("  __syncthreads();")
            w(f"  if (tid == 0) {{ for (int j = 1; j < BLOCK / 32; ++j) t = {fn}(t, js_scr[j]); js_ws[{off} + blockIdx.x] = t; }}")
            w("  __syncthreads();")
            w("}")
    w("js_grid_barrier(reinterpret_cast<unsigned int*>(ws));")
    scalar_ops = [op for op in grid_ops if layout.of(op.outputs[0]).declared != COL]
    col_ops = [op for op in grid_ops if layout.of(op.outputs[0]).declared == COL]
    for op in scalar_ops:
        o, fn = op.outputs[0].id, REDUCE[op.prim][0]
        ident = REDUCE[op.prim][1]["float"]
        w(f"float v{o};")
        w("{")
        w(f"  float t = {ident};")
        w(f"  for (int b = tid; b < gridDim.x; b += BLOCK) t = {fn}(t, js_ws[{offsets[o]} + b]);")
        w(f"  t = js_group_reduce<32>(t, {fn});")
        w("  if ((tid & 31) == 0) js_scr[tid >> 5] = t;")
        w("  __syncthreads();")
        w(f"  t = js_scr[0]; for (int j = 1; j < BLOCK / 32; ++j) t = {fn}(t, js_scr[j]);")
        w(f"  v{o} = t;")
        w("  __syncthreads();")
        w("}")
    scalar_epi = [op for op in epi_ops if layout.of(op.outputs[0]).storage != COL and op not in grid_ops]
    col_epi = [op for op in epi_ops if layout.of(op.outputs[0]).storage == COL and op not in grid_ops]
    for op in scalar_epi:
        k.emit_op(w, op)
    scalar_outs = [v for v in k.outputs if layout.of(v).level == EPILOGUE and layout.of(v).storage != COL]
    for v in scalar_outs:  # a scalar, or one broadcast to rows or to the full [N, C]: every element
        j = k.outputs.index(v)
        w(f"for (long long i = (long long)blockIdx.x * BLOCK + tid; i < {v.size}LL; i += (long long)gridDim.x * BLOCK) "
          f"out{j}[i] = js_io<{STYPE[v.dtype]}>::put({k.ref(v)});")
    if col_ops:
        # A block finishes a group of COL_GROUP columns (one 32-byte sector of a partials row): its
        # threads stride over the blocks' partials rows, then combine in a fixed tree (lanes, then
        # warps through shared memory), so every block of the grid reads at once and the order is fixed.
        shared(f"__shared__ float js_colred[{len(col_ops)}][BLOCK / 32][{COL_GROUP}];")
        w(f"for (int cg = blockIdx.x * {COL_GROUP}; cg < N_COLS; cg += gridDim.x * {COL_GROUP}) {{")
        inner = _Writer(w.indent + 1)
        inner(f"const int c = cg + tid % {COL_GROUP};")
        for i, op in enumerate(col_ops):
            o, fn = op.outputs[0].id, REDUCE[op.prim][0]
            ident = REDUCE[op.prim][1]['float']
            inner(f"float v{o} = {ident};")
            inner(f"if (c < N_COLS) for (int b = tid / {COL_GROUP}; b < gridDim.x; b += BLOCK / {COL_GROUP}) "
                  f"v{o} = {fn}(v{o}, js_ws[{offsets[o]} + (long long)b * N_COLS + c]);")
            inner(f"for (int d = {COL_GROUP}; d < 32; d *= 2) v{o} = {fn}(v{o}, __shfl_xor_sync(0xffffffffu, v{o}, d));")
            inner(f"if ((tid & 31) < {COL_GROUP}) js_colred[{i}][tid >> 5][tid & 31] = v{o};")
        inner("__syncthreads();")
        for i, op in enumerate(col_ops):
            o, fn = op.outputs[0].id, REDUCE[op.prim][0]
            inner(f"v{o} = js_colred[{i}][0][tid % {COL_GROUP}];")
            inner(f"for (int j = 1; j < BLOCK / 32; ++j) v{o} = {fn}(v{o}, js_colred[{i}][j][tid % {COL_GROUP}]);")
        inner("__syncthreads();  // before js_colred is written again")
        inner(f"if (tid >= {COL_GROUP} || c >= N_COLS) continue;")
        for op in col_epi:
            k.emit_op(inner, op)
        for j, v in enumerate(k.outputs):
            if layout.of(v).level == EPILOGUE and layout.of(v).storage == COL:
                put = f"js_io<{STYPE[v.dtype]}>::put({k.ref(v)})"
                if layout.of(v).declared == FULL:  # column values broadcast over the rows
                    inner(f"for (long long r = 0; r < N_ROWS; ++r) out{j}[r * N_COLS + c] = {put};")
                else:
                    inner(f"out{j}[c] = {put};")
        w.lines.extend(inner.lines)
        w("}")
