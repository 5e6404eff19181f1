"""Render a KernelPlan as CUDA C: the plan decides, the template in csrc_templates/ holds the hooks.

The row loop is a sequence of phases separated by rounds of row reductions (reductions.py); row
inputs come through the stash (staging.py); grid-wide reductions finish after the loop
(epilogue.py). `kernel.py` holds what they share: value names, ops, loads and stores.
"""
from __future__ import annotations

import dataclasses
import re
import string

from ..core import ir
from ..core import ops as opdefs
from ..plan import KernelPlan
from ..plan.layout import COL, EPILOGUE, FULL, ROW, SCALAR
from ..plan.remote import RemotePlan
from ..plan.scan import ScanPlan
from ..plan.tile import TilePlan
from . import reductions, remote_codegen, scan_codegen, tile_codegen
from .cuda_ops import CTYPE, REDUCE, STYPE
from .epilogue import render_epilogue
from .kernel import KERNEL_NAME, Kernel, RoundBarriers, Source, Unrenderable, Writer, template, vec_col, vec_col_definition  # noqa: F401 (re-exported)
from .staging import first_row_group, load_chunk, next_buffer, next_row_group, refill_ring, stage_rows


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


def _folded_only(k: Kernel, body_ops) -> set[int]:
    """Ids of ops whose values only online sums read (exp(x - max) and x - max when nothing else
    does): the sum folds them in its max's pass (reductions._online_accumulate), so no later phase
    computes them."""
    readers: dict[int, list[ir.Op]] = {}
    for op in body_ops:
        for a in op.inputs:
            if isinstance(a, ir.Value):
                readers.setdefault(a.id, []).append(op)
    outputs = {v.id for v in k.plan.region.outputs}
    folded: set[int] = set()
    for op in reversed(body_ops):
        outs = [o.id for o in op.outputs]
        if any(o in outputs for o in outs) or opdefs.is_row_reduction(op):
            continue
        users = [u for o in outs for u in readers.get(o, [])]
        if users and all(u.outputs[0].id in k.online_by_sum or id(u) in folded for u in users):
            folded.add(id(op))
    return folded


def _phases(k: Kernel, body_ops, grid_ops, level: dict) -> list[_Phase]:
    layout = k.layout
    phases = []
    folded = _folded_only(k, body_ops)
    for lv in range(max([level[o.outputs[0].id] for o in body_ops] + [0]) + 1):
        made = tuple(op for op in body_ops if not opdefs.is_row_reduction(op) and not opdefs.is_grid_reduction(op)
                     and level[op.outputs[0].id] == lv and id(op) not in folded)
        reds = tuple(op for op in body_ops if opdefs.is_row_reduction(op) and _reduced_in(k, op, level) == lv)
        grids = tuple(op for op in grid_ops if level[op.inputs[0].id] == lv)
        per_elem_grids = tuple(op for op in grids if layout.of(op.inputs[0]).declared == FULL
                               or layout.of(op.outputs[0]).declared == COL)
        stored = tuple(o for op in body_ops if _defined_at(k, op, level) == lv
                       for o in (op.outputs if op.prim == opdefs.VARIADIC else op.outputs[:1]))
        chunk_work = bool(lv == 0 or reds or per_elem_grids
                          or any(layout.of(op.outputs[0]).storage in k.per_chunk for op in made)
                          or any(v in k.outputs and layout.of(v).declared in (FULL, COL) for v in stored))
        phases.append(_Phase(lv, made, reds, grids, per_elem_grids, stored, chunk_work))
    return phases


def _reduced_in(k: Kernel, op: ir.Op, level: dict) -> int:
    """The phase folding a row reduction's operand: its own, or for an online sum its max's."""
    pair = k.online_by_sum.get(op.outputs[0].id)
    if pair:
        return level[pair.source_id]
    return max(level[a.id] for a in opdefs.reduced_operands(op) if isinstance(a, ir.Value))


def _defined_at(k: Kernel, op: ir.Op, level: dict) -> int:
    """The phase whose code defines op's output: a row reduction finishes in the phase folding it."""
    return _reduced_in(k, op, level) if opdefs.is_row_reduction(op) else level[op.outputs[0].id]


def _element_work(k: Kernel, w: Writer, ph: _Phase):
    """A phase's work on this thread's elements of the current chunk."""
    for op in ph.made:
        if k.layout.of(op.outputs[0]).storage in k.per_chunk:
            k.emit_op(w, op)
    reductions.reduce_accumulate(k, w, ph.reductions)
    for v in ph.stored:
        k.store_output(w, v, "chunk")
    for op in ph.per_elem_grids:
        reductions.grid_accumulate(k, w, op)


def _split_one_hot(k: Kernel, w: Writer, emit, tag: int):
    """A one-hot row (`label == iota`) is true in one column of thousands. When `emit`'s code uses
    one, it is emitted twice: the thread's vectors of the chunk that all miss every one-hot column
    (nearly always) run a copy in which those compares are constants, so `one_hot * x` (a select,
    Kernel.predicate_product) is a constant 0 there and sums of it fold away. Exact: the same
    expressions with an operand known. Values made in either copy live only there (later code
    rematerializes). Not where warps hold whole rows (several to a warp, or a warp each, in one
    chunk): every warp then meets its rows' hits and runs both copies, one after the other
    (moe_router's 64 experts on an H100: the miss copy's adds of a zero were on every warp's path)."""
    copies = dict(k.copies)
    k.one_hots_used = {}
    general = Writer(w.indent)
    k.writer = general
    scans = k.scans_emitted
    emit(general)
    used = dict(k.one_hots_used)
    k.writer = w
    whole_rows = k.m.tpr <= 32 and k.m.chunks == 1
    if not used or k.scans_emitted != scans or whole_rows:  # the code as emitted, in place (a scan's
        # barriers and shuffles must be reached by every thread: not split into branches)
        w.lines.extend(general.lines)
        return
    k.copies = dict(copies)
    rows = {k.root(v.id): v for v in used.values()}
    hit = f"js_hit{tag}"
    tests = " || ".join(f"(unsigned int)({k.ref(v)}) - (unsigned int)(ROW_C0 + {vec_col('k')}) < (unsigned int)V"
                        for v in rows.values())
    w(f"bool {hit} = false;  // does a one-hot column fall in one of this thread's vectors?")
    w("#pragma unroll")
    w(f"for (int k = 0; k < VPT; ++k) {hit} = {hit} || {tests};")
    miss = Writer(w.indent + 1)
    k.writer, k.known_misses = miss, frozenset(used)
    emit(miss)
    k.writer, k.known_misses, k.copies = w, frozenset(), copies
    w(f"if (!{hit}) {{")
    w.lines.extend(miss.lines)
    w("} else {")
    w.lines.extend("  " + line for line in general.lines)
    w("}")


def render(plan: KernelPlan | TilePlan | RemotePlan | ScanPlan) -> Source:
    """A KernelPlan as a row-space kernel, a TilePlan as a tile kernel (tile_codegen.py), a
    RemotePlan as a multi-tensor kernel (remote_codegen.py), a ScanPlan as a persistent scan
    (scan_codegen.py)."""
    if isinstance(plan, TilePlan):
        return _writing_every_output(tile_codegen.render(plan), plan.region)
    if isinstance(plan, RemotePlan):
        return Source(remote_codegen.render(plan), KERNEL_NAME, ("P",))
    if isinstance(plan, ScanPlan):
        return scan_codegen.render(plan)
    return _writing_every_output(_render_rows(plan), plan.region)


class UnwrittenOutput(AssertionError):
    """A kernel's source stores nothing to one of its outputs: a code generation bug, which must
    never run (the output would hold whatever memory held)."""


def _writing_every_output(source: Source, region) -> Source:
    """`source`, checked to name each output `out<j>` beyond its parameter: a size-1 output made in
    the row loop but declared a scalar was once stored nowhere (random programs, H200)."""
    body = source.code.split('extern "C"', 1)[-1]
    for j, o in enumerate(region.outputs):
        if len(re.findall(rf"\bout{j}\b", body)) < 2:
            raise UnwrittenOutput(f"the kernel never stores output {j} ({o.shape} {o.dtype})")
    return source


def _render_rows(plan: KernelPlan) -> Source:
    """A KernelPlan as a row-space kernel: the prologue (scalars and column values, the same for
    every row), the row loop's phases, the grid epilogue, in stitch_kernel.cu."""
    k = Kernel(plan)
    region, m = plan.region, plan.mapping
    grid_ops = [op for op in region.ops if opdefs.is_grid_reduction(op)]
    for op in grid_ops:
        if CTYPE[op.outputs[0].dtype] != "float":
            raise Unrenderable(f"{op.prim} over the grid of a {op.outputs[0].dtype} value")
    params = [f"const {STYPE[v.dtype]}* __restrict__ in{i}" for i, v in enumerate(region.inputs)]
    params += [f"{STYPE[v.dtype]}* __restrict__ out{j}" for j, v in enumerate(region.outputs)]
    if m.cooperative:
        params.append("void* __restrict__ ws")
    pro, body, epi = Writer(1), Writer(2), Writer(1)
    early, body_ops, epi_ops = _prologue(k, pro, grid_ops)
    _row_loop(k, pro, body, early, body_ops, grid_ops)
    k.phase = None
    shared = _shared_declarations(k)
    if grid_ops:
        render_epilogue(k, epi, shared, grid_ops, epi_ops)
    return _rows_source(k, params, shared, pro, body, epi)


def _prologue(k: Kernel, pro: Writer, grid_ops: list) -> tuple[list, list, list]:
    """The prologue: scalars and column values, the same for every row this thread visits, and the
    grid reductions' accumulators. Returns the values that exist before the row loop's phases, the
    ops of the row loop and those of the epilogue."""
    region, layout, m = k.plan.region, k.plan.layout, k.plan.mapping
    pro("const int ch = 0;  // the chunk, for code outside chunk loops")
    if m.cooperative:
        pro("float* js_ws = reinterpret_cast<float*>(ws);")
        pro("unsigned int js_gen = js_grid_generation();  // (read long before the first barrier)")
    if k.split:
        pro("unsigned int js_round = 0;  // row barriers crossed (combine_slices)")
        # Rounds of whole rows: a row's slices must meet at the same barriers, so each round runs
        # gridDim.x / SPLITS rows (the planner keeps SPLITS <= the SMs, so at least one fits).
        pro("const long long js_step = (long long)(gridDim.x / SPLITS) * SPLITS;")
        pro("if (js_step == 0) __trap();  // fewer blocks than slices: fail loudly, never a wrong result")
        # A row's blocks meet at their own barrier (combine_slices); blocks past js_step have no row.
        pro("if (gridDim.x / SPLITS > JS_ROW_GROUPS) __trap();")
        pro("unsigned int js_row_gen = blockIdx.x < js_step ? js_row_group_generation(blockIdx.x / SPLITS) : 0u;")
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
        elif p.storage in (SCALAR, COL) and p.storage not in k.per_chunk and (
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
    return early, body_ops, epi_ops


def _row_loop(k: Kernel, pro: Writer, body: Writer, early: list, body_ops: list, grid_ops: list) -> None:
    """The row loop's body: one row per row group, its phases separated by the row reductions,
    with the stash's staged copies (started in the prologue, refilled in the loop)."""
    layout, m = k.plan.layout, k.plan.mapping
    level = {p.value.id: p.level for p in layout.values}
    stash = {s.value_id: s.offset for s in k.plan.stash}
    k.writer = body
    if m.stages:  # the first row groups' copies start before the loop; see mapping.py
        pro("int js_buf = 0;")
        stage_rows(k, pro, stash, first_row_group(k))
        for ahead in range(1, m.stages - 1):  # a ring of STAGES buffers: STAGES - 1 groups in flight
            stage_rows(k, pro, stash, next_row_group(k, ahead, first_row_group(k)), buf=str(ahead))
    phases = _phases(k, body_ops, grid_ops, level)
    k.barriers = _round_barriers(k, phases)
    if m.stages >= 2:  # refill the buffer the last row group was read from (all its reads are done)
        if k.barriers.loop_top:
            body("__syncthreads();")
        refill_ring(k, body, stash)
        body(f"js_stage_wait<{m.stages - 1}>();")
    elif m.stages == 1:
        body("js_stage_wait<0>();")
    for v in k.plan.region.inputs:
        p, i = layout.of(v), k.inputs[v.id]
        if p.storage == ROW:
            body(f"const {k.ctype(v)} v{v.id} = row_ok ? js_io<{STYPE[v.dtype]}>::get(in{i}[row]) : ({k.ctype(v)})0;")
    if not k.chunked:
        load_chunk(k, body, stash, first_phase=True)
    for v in early:
        k.store_output(body, v, "row")
    last_chunk_phase = max(ph.level for ph in phases if ph.chunk_work)
    chunk_passes = 0
    for ph in phases:
        chunk_passes = _row_phase(k, body, ph, stash, early, last_chunk_phase, chunk_passes)
    if m.stages >= 2:
        body(next_buffer(m.stages))
    if k.smem_rounds != k.barriers.rounds or bool(k.scan_smem) != k.barriers.smem_scans:
        raise Unrenderable(f"the row loop wrote {k.smem_rounds} rounds through shared memory "
                           f"and {len(k.scan_smem)} scans' arrays, planned {k.barriers.rounds} and "
                           f"{k.barriers.smem_scans}")


def _round_barriers(k: Kernel, phases: list[_Phase]) -> RoundBarriers:
    """The barriers of the row loop's rounds through shared memory, from its phases before any line
    is written. A row wider than a warp finishes each phase's row reductions in one round through
    js_red, round r in bank r % 2: a bank is written again two rounds later, past the other round's
    barrier, so only the last round of an odd count needs a barrier after its reads, and not even
    that where the loop's top has one. The top's barrier (rings of two or more stages) orders the
    refill of the buffer last read; with no rounds and no scans through shared memory there is
    nothing else for it to order, since each thread reads back only the slots it copied itself
    (moe_router's row kernel, H100: 2-3%)."""
    m = k.plan.mapping
    rounds = sum(1 for ph in phases if ph.reductions) if m.tpr > 32 else 0
    smem_scans = m.tpr > 32 and any(op.prim in opdefs.SCANS for op in k.plan.region.ops)
    loop_top = m.stages >= 2 and (rounds > 0 or smem_scans)
    return RoundBarriers(rounds=rounds, smem_scans=smem_scans, loop_top=loop_top,
                         last_round=rounds % 2 == 1 and not loop_top)


def _row_phase(k: Kernel, body: Writer, ph, stash: dict, early: list, last_chunk_phase: int,
               chunk_passes: int) -> int:
    """One phase of the row loop: its row values (outside any chunk loop), then its per-element
    work chunk by chunk, then its row reductions' ends, stores and grid accumulations. Returns the
    chunk passes made so far (a serpentine mapping turns round every pass)."""
    m, per_chunk = k.plan.mapping, k.per_chunk
    lv = k.phase = ph.level
    for op in ph.made:
        if k.plan.layout.of(op.outputs[0]).storage not in per_chunk:
            k.emit_op(body, op)
    reductions.reduce_init(k, body, ph.reductions)
    w = body
    loop_at = len(body.lines)
    if k.chunked and ph.chunk_work:
        # (a scan's carry runs one way; otherwise a serpentine mapping turns round every pass)
        backward = k.reverse_chunks or (m.serpentine and chunk_passes % 2 == 1)
        chunk_passes += 1
        body("for (int ch = CHUNKS - 1; ch >= 0; --ch) {" if backward else
             "for (int ch = 0; ch < CHUNKS; ++ch) {")
        w = k.writer = Writer(body.indent + 1)
        load_chunk(k, w, stash, first_phase=lv == 0, last_read=lv == last_chunk_phase)
    if lv == 0:
        for v in early:
            k.store_output(w, v, "chunk")
    _split_one_hot(k, w, lambda wr, ph=ph: _element_work(k, wr, ph), tag=lv)
    refill = m.stages == 1 and lv == last_chunk_phase  # the stash is read for the last time
    if refill and k.chunked:
        # Chunk by chunk, as soon as this thread has read its slots of the chunk (a thread's slots
        # are its own: no barrier), so the next row's copies overlap this pass's work.
        stage_rows(k, w, stash, next_row_group(k), one_chunk=True)
    if k.chunked and ph.chunk_work:
        body.lines.extend(w.lines)
        body("}")
        k.writer = body
    body.lines[loop_at:loop_at] = ["  " * body.indent + c for c in k.carries]  # scans' carries
    k.carries = []
    if refill and k.chunked:
        body("js_stage_commit();")
    elif refill:
        body("__syncthreads();")
        stage_rows(k, body, stash, next_row_group(k))
    reductions.reduce_finish(k, body, ph.reductions)
    for v in ph.stored:
        k.store_output(body, v, "row")
    for op in ph.grids:
        if op not in ph.per_elem_grids:
            reductions.grid_accumulate(k, body, op)
    return chunk_passes


def _shared_declarations(k: Kernel) -> Writer:
    """The kernel's static shared memory: row reductions' and scans' exchange, the stash."""
    m = k.plan.mapping
    shared = Writer(1)
    if m.tpr > 32 and k.n_row_red:
        shared(f"__shared__ float js_red[2][{k.n_row_red}][RPB][NWARPS_ROW];")
        shared(f"__shared__ int js_redi[2][{k.n_row_red}][RPB][NWARPS_ROW];")
    for ct in sorted(k.scan_smem):
        shared(f"__shared__ {ct} js_scan_{ct}[RPB][NWARPS_ROW * VPT];")
    if m.smem_bytes:
        shared("extern __shared__ __align__(16) unsigned char js_dyn[];")
    return shared


def _rows_source(k: Kernel, params: list, shared: Writer, pro: Writer, body: Writer, epi: Writer) -> Source:
    """The row kernel's parts in stitch_kernel.cu, with its row loop's head."""
    plan, m = k.plan, k.plan.mapping
    if k.split:  # one task per (row, slice); every block runs the same number of rounds (its row's barriers)
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
    summary = f"{len(plan.region.ops)} ops, rows of {m.n_cols}, {plan.description}, scheme {plan.scheme}"
    code = string.Template(template("stitch_kernel.cu")).substitute(
        summary=summary, common=template("stitch_common.cuh"), n_cols=m.n_cols,
        vec=m.vec, tpr=m.tpr, vpt=m.vpt, chunks=m.chunks, stash_chunks=m.stashed_chunks, rows_per_block=m.rows_per_block, block=m.block,
        min_blocks=m.min_blocks, splits=m.splits, slice=m.slice_cols,
        row_c0="js_c0" if k.split else "0", row_cols="js_ncols" if k.split else "N_COLS", loop_head=loop_head,
        vec_col=vec_col_definition(m.pair, m.vec),
        name=KERNEL_NAME, params=", ".join(params), functions="\n".join(k.functions.values()),
        shared=shared.text(), prologue=pro.text(),
        body=body.text(), epilogue=epi.text())
    return Source(code, KERNEL_NAME, tuple(params))
