"""What every part of a rendered kernel shares: the template files, the names of a thread's columns
and stash slots, a line writer, and `Kernel`, which names values and emits ops, loads and stores.

Values are named `v<id>`. A value stored per element (full or column storage) is an array of E
registers indexed by the thread's element slot; a row or scalar value is one register. Layout ops
emit nothing: their result is another name for the operand.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from importlib import resources

from ..core import ir
from ..core import ops as opdefs
from ..plan import KernelPlan
from ..plan.layout import COL, EPILOGUE, FULL, GATHER, PAIR_HALF, PAIR_SWAP, ROW, SCALAR, row_axes
from ..plan.views import merged_axes
from .cuda_ops import (
    CTYPE,
    SCAN,
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

KERNEL_NAME = "jaxstitch_kernel"


@dataclasses.dataclass(frozen=True)
class Source:
    """A kernel's CUDA C, its `extern "C"` name and its parameters' names, in launch order."""

    code: str
    name: str
    param_names: tuple[str, ...]


class Unrenderable(AssertionError):
    """A plan the templates have no form for: the planner refuses such plans (planner.unrenderable),
    so meeting one here is a planner bug; its region is left to XLA."""


@functools.lru_cache(maxsize=None)
def template(name: str) -> str:
    return resources.files("jaxstitch.csrc_templates").joinpath(name).read_text()


def vec_col(k: str) -> str:
    """The first column of this thread's vector `k` in chunk `ch` (the template's JS_VEC_COL)."""
    return f"JS_VEC_COL({k})"


def vec_col_definition(pair: int, vec: int) -> str:
    """JS_VEC_COL's body: the row's vectors dealt to its TPR threads in turn; with halves of `pair`
    columns paired (plan/pairs.py), a thread's vectors 2i and 2i + 1 are a vector of the first half
    of a 2 * pair group and the one `pair` after it, its lanes spread over groups and halves."""
    if not pair:
        return "(((ch) * VPT + (k)) * TPR + lane) * V"
    lanes = pair // vec
    return (f"((((ch) * (VPT / 2) + (k) / 2) * (TPR / {lanes}) + lane / {lanes}) * 2 + (k) % 2) * {pair}"
            f" + lane % {lanes} * V")


def col_index(e: str) -> str:
    """The column (of the whole row) of this thread's element slot `e` in chunk `ch`."""
    return f"(ROW_C0 + {vec_col(f'({e}) / V')} + ({e}) % V)"


def stash_slot(ptr: str) -> str:
    """This thread's vector `k` of chunk `ch` in a stash buffer at `ptr`: slots interleave the block's
    threads, so a warp's 16-byte accesses are contiguous."""
    return f"{ptr} + ((ch * VPT + k) * BLOCK + tid) * V"


class Writer:
    def __init__(self, indent: int):
        self.lines: list[str] = []
        self.indent = indent

    def __call__(self, line: str = ""):
        self.lines.append("  " * self.indent + line)

    def text(self) -> str:
        return "\n".join(self.lines)

    @contextlib.contextmanager
    def block(self, head: str):
        """`head` (ending in an opening brace), the lines written inside indented, a closing brace."""
        self(head)
        self.indent += 1
        yield
        self.indent -= 1
        self("}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoundBarriers:
    """The row loop's barriers around its rounds through shared memory (codegen._round_barriers)."""

    rounds: int        # rounds of row reductions through js_red a row
    smem_scans: bool   # scans whose warps meet through shared memory
    loop_top: bool     # a barrier at the loop's top, before the stage ring's refill
    last_round: bool   # a barrier after the last round's reads


class Kernel:
    """Codegen's working state for one row kernel: the plan and the names it has given values so far,
    shared by the prologue, body and epilogue writers (mutable: it lives only while rendering)."""

    def __init__(self, plan: KernelPlan):
        self.plan = plan
        self.layout = plan.layout
        self.m = plan.mapping
        self.alias: dict[int, int] = {}
        self.inputs = {v.id: i for i, v in enumerate(plan.region.inputs)}
        self.outputs = list(plan.region.outputs)
        self.rounds_written = written_half(plan.region, self.inputs)
        self.split = self.m.splits > 1
        self.exact_cols = (self.m.chunks * self.m.vpt * self.m.tpr * self.m.vec == self.m.slice_cols
                           and self.m.slice_cols * self.m.splits == self.m.n_cols)
        # A split row's slice changes with the block's task: it is walked as a chunked row is.
        self.chunked = self.m.chunks > 1 or self.split
        # Per-chunk kinds: what a thread holds as E-element arrays, made again for every chunk of a row.
        self.per_chunk = (FULL, COL) if self.chunked else (FULL,)
        self.n_row_red = 0
        # Online softmax pairs (plan/online.py), by the max's and by the sum's output.
        self.online_by_max = {o.max_id: o for o in plan.online}
        self.online_by_sum = {i: o for o in plan.online for i in o.sum_ids}  # weighted sums too
        self.producer = {o.id: op for op in plan.region.ops for o in op.outputs}
        # The row loop's rounds through shared memory: their barriers, decided before the loop is
        # written (codegen._round_barriers), and the rounds written so far (round r uses bank r % 2).
        self.barriers = RoundBarriers(rounds=0, smem_scans=False, loop_top=False, last_round=False)
        self.smem_rounds = 0
        # Rematerialization: a full-size value is kept in registers only within the phase that made
        # it; a later phase recomputes it from the loaded inputs, so the registers held across the
        # row reductions are just the inputs' (memory-bound kernels have ALU to spare).
        self.phase: int | None = None
        self.writer: Writer | None = None
        self.def_op: dict[int, ir.Op] = {}
        self.def_phase: dict[int, int] = {}
        self.copies: dict[tuple[int, int], str] = {}
        # Values that are a float rounded to a half type: stored from the float itself, since the
        # store rounds it the same way (one rounding instead of two).
        self.rounded_from: dict[int, ir.Atom] = {}
        # One-hot compares met while emitting (output id -> row value), and those known to be false
        # (eq) / true (ne) in the code being emitted: see codegen's one-hot split.
        self.one_hots_used: dict[int, ir.Value] = {}
        self.known_misses: frozenset[int] = frozenset()
        # Scans (ops.SCANS): a chunked row's passes walk its chunks in the scans' direction (the
        # planner keeps them to one); each scan's carry from chunk to chunk is declared before the
        # pass's chunk loop (`carries`, taken by codegen); `scan_smem`: compute types whose warp
        # totals meet in shared memory.
        self.reverse_chunks = any(op.param("reverse") for op in plan.region.ops if op.prim in opdefs.SCANS)
        self.carries: list[str] = []
        self.scans_emitted = 0
        self.scan_smem: set[str] = set()
        # Device functions the kernel calls (a variadic reduce's combiner), by name: defined before it.
        self.functions: dict[str, str] = {}

    # ---- naming -------------------------------------------------------------------------------
    def root(self, vid: int) -> int:
        while vid in self.alias:
            vid = self.alias[vid]
        return vid

    def placed(self, v: ir.Value):
        return self.layout.of(v)

    def is_array(self, v: ir.Value) -> bool:
        return self.placed(v).storage in (FULL, COL) and self.placed(v).level != EPILOGUE

    def ref(self, a: ir.Atom, e: str = "e", stored: bool = False) -> str:
        """The C expression of `a`'s element `e`: a half-precision value the kernel also writes is
        read rounded, as written (see written_half), except by its store (`stored`)."""
        if isinstance(a, ir.Const):
            return literal(a.value, a.dtype)
        root = self.root(a.id)
        name = f"v{root}"
        if self.phase is not None and self.def_phase.get(root, self.phase) != self.phase:
            name = self.rematerialize(root)
        expr = f"{name}[{e}]" if self.is_array(a) else name
        return expr if stored else as_written(self.rounds_written, root, expr)

    def rematerialize(self, root: int) -> str:
        key = (root, self.phase)
        if key not in self.copies:
            name = f"v{root}_p{self.phase}"
            op = self.def_op[root]  # (a scan folds again: the same folds in the same order, the same bits)
            self.emitter(op)(self.writer, op, name)
            self.copies[key] = name
        return self.copies[key]

    def remember(self, op: ir.Op):
        """An array made in this phase: later phases recompute it (see rematerialize)."""
        out = op.outputs[0]
        if self.phase is not None and self.is_array(out):
            self.def_op[out.id], self.def_phase[out.id] = op, self.phase

    def ctype(self, v: ir.Value) -> str:
        return CTYPE[v.dtype]

    def each_element(self, w: Writer, stmt: str, guard: str = ""):
        """`stmt` for each of this thread's elements `e` in a real column (and `guard`), in element
        order. The column test is per vector, so the compiler branches once per vector, not per element
        (it branched around each element's exp, and predicated nothing)."""
        w("#pragma unroll")
        if self.exact_cols:
            w(f"for (int e = 0; e < E; ++e) {'if (' + guard + ') ' if guard else ''}{stmt}")
            return
        # (V divides N_COLS and SLICE: a vector is in the row whole or not at all)
        w(f"for (int k = 0; k < VPT; ++k) if ({guard + ' && ' if guard else ''}{vec_col('k')} < ROW_COLS) {{")
        w("  #pragma unroll")
        w(f"  for (int i = 0; i < V; ++i) {{ const int e = k * V + i; {stmt} }}")
        w("}")

    # ---- ops --------------------------------------------------------------------------------------
    def elementwise(self, w: Writer, op: ir.Op, name: str | None = None):
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
            expr = self.column_compare(op) or self.predicate_product(op, args) or self.expr(op, args)
        expr = as_xla_rounds(op, expr, self.plan.region.shared)
        if (src := rounded_float(op)) is not None:
            self.rounded_from[out.id] = src
        if self.is_array(out):
            w(f"{self.ctype(out)} {name}[E];")
            w("#pragma unroll")
            w(f"for (int e = 0; e < E; ++e) {name}[e] = {expr};")
        else:
            w(f"const {self.ctype(out)} {name} = {expr};")

    def one_hot_row(self, op: ir.Op) -> ir.Value | None:
        """The row value of `label == iota` / `label != iota` (an int per row against the column
        index: a one-hot row), else None."""
        if op.prim not in ("eq", "ne") or not all(isinstance(a, ir.Value) for a in op.inputs):
            return None
        for col, other in (op.inputs, op.inputs[::-1]):
            src = self.producer.get(self.root(col.id))
            if src is None or src.prim != "iota" or self.is_array(other) or CTYPE[other.dtype] != "int":
                continue
            p = self.placed(src.outputs[0])
            if p.storage == COL and p.iota[0] == 1 and p.iota[1] >= self.m.n_cols:
                return other
        return None

    def expr(self, op: ir.Op, args: list[str]) -> str:
        return expression(op, args, self.plan.fast_exp)

    def predicate_product(self, op: ir.Op, args: list[str]) -> str | None:
        """`x * convert(pred)` as `pred ? x : 0` (cuda_ops.bool_factor), else None."""
        found = bool_factor(op, self.producer)
        if found is None:
            return None
        i, pred = found
        return select_product(self.ref(pred), args[1 - i], self.ctype(op.outputs[0]))

    def column_compare(self, op: ir.Op) -> str | None:
        """A one-hot compare as one compare per element: the row value minus the vector's first
        column, against the element's offset in the vector (the difference is made once per vector).
        Unsigned, so it cannot overflow. In code for vectors known to miss the row's column
        (`known_misses`, see codegen's one-hot split) it is a constant."""
        other = self.one_hot_row(op)
        if other is None:
            return None
        self.one_hots_used[op.outputs[0].id] = other
        if op.outputs[0].id in self.known_misses:
            return "false" if op.prim == "eq" else "true"
        first = f"(unsigned int)(ROW_C0 + {vec_col('(e) / V')})"
        cmp = "==" if op.prim == "eq" else "!="
        return f"((unsigned int)({self.ref(other)}) - {first} {cmp} (unsigned int)((e) % V))"

    def iota(self, w: Writer, op: ir.Op, name: str | None = None):
        out = op.outputs[0]
        if name is None:
            name = f"v{out.id}"
            self.remember(op)
        stride, size = self.placed(out).iota
        ct = self.ctype(out)
        if self.placed(out).storage == ROW:
            w(f"const {ct} {name} = ({ct})((row / {stride}) % {size});")
        elif self.placed(out).storage == COL:
            expr = col_index("e") + (f" / {stride}" if stride > 1 else "")
            if stride * size < self.m.n_cols:  # else the quotient is below `size` already
                expr += f" % {size}"
            w(f"{ct} {name}[E];")
            w("#pragma unroll")
            w(f"for (int e = 0; e < E; ++e) {name}[e] = ({ct})({expr});")
        else:
            w(f"const {ct} {name} = 0;")

    def gather(self, w: Writer, op: ir.Op, name: str | None = None):
        """Load an input at the indices of a view (plan/views.py): row axes indexed by `row`, column
        axes by each element's column. Vector loads where every vector of the columns is one of the
        source (_vector_readable); element loads otherwise."""
        out, src = op.outputs[0], op.inputs[0]
        if name is None:
            name = f"v{out.id}"
            self.remember(op)
        view, storage = op.param("view"), self.placed(out).storage
        st, ct, ptr = STYPE[src.dtype], self.ctype(out), f"in{self.inputs[src.id]}"
        dims = list(zip(view.shape, view.strides))
        j = row_axes(view.shape, self.m.n_rows) if storage == FULL else (len(dims) if storage == ROW else 0)
        base = [str(view.offset)] if view.offset else []
        for a, limit, stride in zip(op.inputs[1:], view.dyn_limits, view.dyn_strides):
            base.append(f"(long long)min(max((int){self.ref(a)}, 0), {limit}) * ({stride}LL)")
        if j:
            base.append(_affine(dims[:j], "row"))
        base_expr = " + ".join(base) or "0"

        def load(index: str) -> str:
            if not view.exact:
                index = f"min(max((long long)({index}), 0LL), {view.size - 1}LL)"
            return f"js_io<{st}>::get({ptr}[{index}])"

        if storage == SCALAR:
            w(f"const {ct} {name} = {load(base_expr)};")
            return
        if storage == ROW:
            w(f"const {ct} {name} = row_ok ? {load(base_expr)} : ({ct})0;")
            return
        row_ok = "row_ok && " if storage == FULL else ""
        # (a concatenation's operand along rows: nothing loaded in the other operands' rows)
        outside = [b for b in view.bounds if j and not any(b[1][j:])] if storage == FULL else []
        if outside:
            inside = " && ".join(f"(unsigned long long)({c}LL + {_affine(list(zip(view.shape[:j], coef)), 'row')}) "
                                 f"< {n}ULL" for c, coef, n in outside)
            w(f"const bool {name}_in = {inside};")
            row_ok = f"row_ok && {name}_in && "
        w(f"const long long {name}_at = {base_expr};")
        w(f"{ct} {name}[E];")
        w("#pragma unroll")
        w("for (int k = 0; k < VPT; ++k) {")
        w(f"  const int col0 = {vec_col('k')};")
        if _vector_readable(view, dims[j:], dims[:j], self.m.vec):
            index = f"{name}_at + {_affine(dims[j:], '(ROW_C0 + col0)', column=True)}"
            if not view.exact:  # (an aligned vector of the source: its values are don't-cares)
                index = f"min(max((long long)({index}), 0LL), {view.size - self.m.vec}LL)"
            w(f"  if ({row_ok}col0 < ROW_COLS) js_load<{st}, V>({ptr} + {index}, &{name}[k * V]);")
            w(f"  else for (int i = 0; i < V; ++i) {name}[k * V + i] = ({ct})0;")
        else:
            index = f"{name}_at + {_affine(dims[j:], '(ROW_C0 + col0 + i)', column=True)}"
            w("  #pragma unroll")
            w(f"  for (int i = 0; i < V; ++i) {name}[k * V + i] = {row_ok}col0 < ROW_COLS ? {load(index)} : ({ct})0;")
        w("}")

    def scan(self, w: Writer, op: ir.Op, name: str | None = None):
        """A cumulative fold along the row. Element (chunk, vector k, lane, i) follows, in row order,
        the chunks before it (the carry), the row's vectors k before it (each vector slot spans the
        row's lanes), the lanes before it in its slot, and the elements before it in its vector. So a
        thread folds each of its vectors, its lane group scans the vector totals (shuffles; warps
        through shared memory), and the carry moves on slot by slot. Reverse scans go the other way."""
        out, src = op.outputs[0], op.inputs[0]
        if name is None:
            name = f"v{out.id}"
            self.remember(op)
        self.scans_emitted += 1
        rev = bool(op.param("reverse"))
        ct = self.ctype(out)
        fn, ident = SCAN[op.prim][0], SCAN[op.prim][1][ct]
        x = self.ref(src)  # (before any brace: a rematerialized operand is defined at this level)
        carry = f"{name}_c"
        if self.chunked:
            self.carries.append(f"{ct} {carry} = {ident};")
        else:
            w(f"{ct} {carry} = {ident};")
        w(f"{ct} {name}[E];")
        w("{  // " + f"{op.prim}{' (reverse)' if rev else ''} along the row")
        w(f"  {ct} js_t[VPT], js_x[VPT], js_s[VPT];  // per vector slot: fold, fold before it, slot total")
        w("  #pragma unroll")
        w("  for (int k = 0; k < VPT; ++k) {")
        real = "true" if self.exact_cols else f"{vec_col('k')} < ROW_COLS"
        w(f"    const bool js_in = {real};  // (past the row: the identity, which a reverse scan meets first)")
        w(f"    {ct} js_a = {ident};")
        w("    #pragma unroll")
        e = "k * V + V - 1 - i" if rev else "k * V + i"
        w(f"    for (int i = 0; i < V; ++i) {{ const int e = {e}; js_a = {fn}(js_a, js_in ? ({ct})({x}) : {ident}); {name}[e] = js_a; }}")
        w("    js_t[k] = js_a;")
        w("  }")
        lanes, r = min(self.m.tpr, 32), "true" if rev else "false"
        w(f"  js_lanes_scan<{lanes}, {r}, VPT>(js_t, {fn});")
        w(f"  js_lanes_split<{lanes}, {r}, VPT>(js_t, js_x, js_s, {ident});")
        if self.m.tpr > 32:
            self.scan_smem.add(ct)
            w(f"  js_warps_scan<NWARPS_ROW, {r}, VPT>(js_x, js_s, js_scan_{ct}[row_in_block], lane >> 5, ({ct}){ident}, {fn});")
        w("  #pragma unroll")
        w("  for (int j = 0; j < VPT; ++j) {")
        w(f"    const int k = {'VPT - 1 - j' if rev else 'j'};")
        w(f"    const {ct} js_b = {fn}({carry}, js_x[k]);")
        w("    #pragma unroll")
        w(f"    for (int i = 0; i < V; ++i) {name}[k * V + i] = {fn}(js_b, {name}[k * V + i]);")
        w(f"    {carry} = {fn}({carry}, js_s[k]);")
        w("  }")
        w("}")

    def pair_swap(self, w: Writer, op: ir.Op, name: str | None = None):
        """An array's partner columns (plan/pairs.py): a paired mapping's vector slot k ^ 1 holds
        the partner of slot k's column, so element e's partner is element e ^ V (V a power of two)."""
        self._per_element(w, op, name, self.ctype(op.outputs[0]), self.ref(op.inputs[0], "(e) ^ V"))

    def pair_half(self, w: Writer, op: ir.Op, name: str | None = None):
        """Whether a column is in the second half of its pair group: its vector slot's parity, a
        constant once the element loops are unrolled, so selects on it are decided at compile time."""
        self._per_element(w, op, name, "bool", f"((e) / V) % 2 == {int(op.param('second'))}")

    def _per_element(self, w: Writer, op: ir.Op, name: str | None, ctype: str, expr: str):
        """An E-element array `name` (default: the op's value, remembered for later phases) of
        `expr` at each element e."""
        if name is None:
            name = f"v{op.outputs[0].id}"
            self.remember(op)
        w(f"{ctype} {name}[E];")
        w("#pragma unroll")
        w(f"for (int e = 0; e < E; ++e) {name}[e] = {expr};")

    def emit_op(self, w: Writer, op: ir.Op):
        if opdefs.is_layout(op) and isinstance(op.inputs[0], ir.Const):
            out = op.outputs[0]
            w(f"const {self.ctype(out)} v{out.id} = {literal(op.inputs[0].value, out.dtype)};")
        elif opdefs.is_layout(op):
            self.alias[op.outputs[0].id] = self.root(op.inputs[0].id)
        else:
            self.emitter(op)(w, op)

    def emitter(self, op: ir.Op):
        """The method that emits an op computing values: `(writer, op, name=None)`."""
        if op.prim in opdefs.SCANS:
            return self.scan
        return {"iota": self.iota, GATHER: self.gather, PAIR_SWAP: self.pair_swap,
                PAIR_HALF: self.pair_half}.get(op.prim, self.elementwise)

    # ---- memory -----------------------------------------------------------------------------------
    @property
    def partial_stash(self) -> bool:
        return self.m.stashed_chunks < self.m.chunks

    def load_array(self, w: Writer, v: ir.Value, ptr: str, per_row: bool, stash: str | None = None,
                   from_stash: bool = False, last_read: bool = False):
        """E elements of `v` owned by this thread (of the current chunk): of the current row, or of the
        column vector. `stash` names this input's shared-memory stash: the first phase copies the
        loaded vectors there, later phases read them back (each thread only its own slots). Chunks past
        a partial stash are read from global memory, kept in L2 until the `last_read`."""
        ct, st = self.ctype(v), STYPE[v.dtype]
        slot = stash_slot(stash) if stash else None
        w(f"{ct} v{v.id}[E];")
        w("#pragma unroll")
        w("for (int k = 0; k < VPT; ++k) {")
        w(f"  const int col0 = {vec_col('k')};")
        guard = f"{'row_ok && ' if per_row else ''}col0 < ROW_COLS"
        if stash is None:
            w(f"  if ({guard}) js_load<{st}, V>({ptr} + col0, &v{v.id}[k * V]);")
        elif from_stash and self.partial_stash:
            keep = "false" if last_read else "true"
            w(f"  if ({guard} && ch < STASH_CHUNKS) js_load<{st}, V>({slot}, &v{v.id}[k * V]);")
            w(f"  else if ({guard}) js_load_l2<{st}, V, {keep}>({ptr} + col0, &v{v.id}[k * V]);")
        elif from_stash:
            w(f"  if ({guard}) js_load<{st}, V>({slot}, &v{v.id}[k * V]);")
        else:
            w(f"  if ({guard}) js_load_stash<{st}, V>({ptr} + col0, {slot}, &v{v.id}[k * V]);")
        w(f"  else for (int i = 0; i < V; ++i) v{v.id}[k * V + i] = ({ct})0;")
        w("}")

    def store_array(self, w: Writer, v: ir.Value, out_index: int, guard: str, base: str):
        st = STYPE[v.dtype]
        w("#pragma unroll")
        w("for (int k = 0; k < VPT; ++k) {")
        w(f"  const int col0 = {vec_col('k')};")
        w(f"  if ({guard}col0 < ROW_COLS) {{")
        src = self.rounded_from.get(self.root(v.id), v)
        w(f"    {self.ctype(src)} t[V];")
        w("    for (int i = 0; i < V; ++i) { const int e = k * V + i; t[i] = " + self.ref(src, stored=True) + "; }")
        stream = ", true" if self.partial_stash else ""  # streamed past L2 (see js_store)
        w(f"    js_store<{st}, V{stream}>(out{out_index} + {base}col0, t);")
        w("  }")
        w("}")

    def store_output(self, w: Writer, v: ir.Value, where: str):
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
            elif p.declared in (COL, SCALAR) and p.storage == FULL:  # (made per element in the row loop)
                if where == "chunk" and p.declared == COL:  # the row-0 tasks (every slice of row 0)
                    with w.block("if (row == 0) {"):
                        self.store_array(w, o, j, "", "ROW_C0 + ")
                elif where == "chunk":  # row 0's first element
                    w(f"if (row == 0 && lane == 0 && ROW_C0 == 0 && ch == 0) "
                      f"out{j}[0] = js_io<{st}>::put({self.ref(o, '0', stored=True)});")
            elif where == "row" and p.declared == ROW:
                w(f"if (row_ok && lane == 0 && ROW_C0 == 0) out{j}[row] = js_io<{st}>::put({self.ref(o, '0', stored=True)});")
            elif p.declared == COL and (where, self.chunked and p.storage == COL) in (("prologue", False), ("chunk", True)):
                if where == "chunk":  # the row-0 tasks (every slice of row 0)
                    w("if (row == 0) {")
                    self.store_array(w, o, j, "", "ROW_C0 + ")
                elif self.chunked:  # (a value the same in every column: block 0 walks the whole row)
                    w("if (blockIdx.x == 0) {")
                    w(f"  for (int c = tid; c < N_COLS; c += BLOCK) out{j}[c] = "
                      f"js_io<{st}>::put({self.ref(o, '0', stored=True)});")
                else:
                    w("if (blockIdx.x == 0 && row_in_block == 0) {")
                    self.store_array(w, o, j, "", "")
                w("}")
            elif where == "prologue" and p.declared == SCALAR:
                w(f"if (blockIdx.x == 0 && tid == 0) out{j}[0] = js_io<{st}>::put({self.ref(o, '0', stored=True)});")


def _affine(dims, var: str, column: bool = False) -> str:
    """sum over `dims` (size, stride) of the index along each times its stride, for the flat index
    `var` of their row-major space (a long long expression). Axes the source holds contiguously
    are merged first (`x % n * s + x / n * n * s` is `x * s`). `column`: `var` is a column of the
    row (0 <= var < 2**31), whose digits are taken in 32-bit unsigned arithmetic, where a
    power-of-two size is a shift and a mask. (A gather computes its index for every element, and
    kernels that gather are bound by the instructions they issue: the target's calibration.gather_ops_per_sm_us.)"""
    dims = merged_axes(dims)
    cast, suffix = ("unsigned", "u") if column else ("long long", "")
    terms, inner = [], 1
    total = math.prod(size for size, _ in dims)
    for size, stride in reversed(dims):
        if size > 1 and stride:
            idx = f"({cast})({var})" if inner == 1 else f"(({cast})({var}) / {inner}{suffix})"
            if inner * size < total:
                idx = f"({idx} % {size}{suffix})"
            if column:
                idx = f"(long long){idx}"
            terms.append(f"{idx} * ({stride}LL)")
        inner *= size
    return "(" + (" + ".join(terms) or "0LL") + ")"


def _vector_readable(view, col_dims, row_dims, vec: int) -> bool:
    """Whether each vector of a gather's columns is a vector of its source: the innermost column
    axis contiguous and a multiple of vectors long, every other offset a multiple of a vector (a
    don't-care vector is clamped into the source, which must then be whole vectors too)."""
    real = [(n, s) for n, s in col_dims if n > 1]
    if not real or real[-1][1] != 1 or real[-1][0] % vec:
        return False
    others = [s for _, s in real[:-1]] + [s for n, s in row_dims if n > 1] + list(view.dyn_strides)
    return (view.offset % vec == 0 and all(s % vec == 0 for s in others)
            and (view.exact or view.size % vec == 0))
