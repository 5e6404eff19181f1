"""After the row loop: grid-wide reductions (block partials through the workspace, one grid barrier,
then every block finishes a share in a fixed order) and the values made from them."""
from __future__ import annotations

from ..plan.layout import COL, EPILOGUE, FULL
from .cuda_ops import REDUCE, STYPE
from .kernel import Kernel, Writer, col_index


def render_epilogue(k: Kernel, w: Writer, shared: Writer, grid_ops, epi_ops):
    """Grid-wide reductions: block partials to the workspace, one barrier, then every block finishes
    a slice of the columns (and every block the scalars), summing partials in a fixed order."""
    layout = k.layout
    offsets = {g.value_id: g.offset for g in k.plan.grid_reductions}
    _block_partials(k, w, shared, grid_ops, offsets)
    w("js_grid_sync(js_gen);")
    scalar_ops = [op for op in grid_ops if layout.of(op.outputs[0]).declared != COL]
    col_ops = [op for op in grid_ops if layout.of(op.outputs[0]).declared == COL]
    for op in scalar_ops:
        _scalar_finish(w, op, offsets[op.outputs[0].id])
    scalar_epi = [op for op in epi_ops if layout.of(op.outputs[0]).storage != COL and op not in grid_ops]
    col_epi = [op for op in epi_ops if layout.of(op.outputs[0]).storage == COL and op not in grid_ops]
    for op in scalar_epi:
        k.emit_op(w, op)
    scalar_outs = [v for v in k.outputs if layout.of(v).level == EPILOGUE and layout.of(v).storage != COL]
    for v in scalar_outs:  # a scalar, or one broadcast to rows or to the full [N, C]: every element
        j = k.outputs.index(v)
        w(f"for (long long i = (long long)blockIdx.x * BLOCK + tid; i < {v.size}LL; i += (long long)gridDim.x * BLOCK) "
          f"out{j}[i] = js_io<{STYPE[v.dtype]}>::put({k.ref(v, stored=True)});")
    if col_ops:
        _column_finish(k, w, shared, col_ops, col_epi, offsets)


def _block_partials(k: Kernel, w: Writer, shared: Writer, grid_ops, offsets: dict) -> None:
    """Each block's partials of the grid reductions to the workspace: a column reduction's row
    groups combined first (by shuffles, then through shared memory), a scalar's over the block."""
    layout, m = k.layout, k.plan.mapping
    shared("__shared__ float js_scr[BLOCK / 32];")
    if m.rows_per_block > 1 and any(layout.of(op.outputs[0]).declared == COL for op in grid_ops):
        shared("__shared__ float js_colbuf[N_COLS];")
    for op in grid_ops:
        o, fn = op.outputs[0].id, REDUCE[op.prim][0]
        off = offsets[o]
        if layout.of(op.outputs[0]).declared == COL:
            if m.rows_per_block == 1:
                w("#pragma unroll")
                w("for (int e = 0; e < E; ++e) { const int c = " + col_index("e") + "; "
                  f"if (c < N_COLS) js_ws[{off} + (long long)blockIdx.x * N_COLS + c] = a{o}[e]; }}")
            else:
                step = "1"
                if m.tpr < 32:  # the row groups of a warp first, by shuffles: one warp's sum per loop step
                    step = "32 / TPR"
                    w("#pragma unroll")
                    w(f"for (int e = 0; e < E; ++e) for (int d = TPR; d < 32; d *= 2) "
                      f"a{o}[e] = {fn}(a{o}[e], __shfl_xor_sync(0xffffffffu, a{o}[e], d));")
                w(f"for (int rg = 0; rg < RPB; rg += {step}) {{")
                w("  if (row_in_block == rg) {")
                w("#pragma unroll")
                w("    for (int e = 0; e < E; ++e) { const int c = " + col_index("e") + "; "
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


def _scalar_finish(w: Writer, op, offset: int) -> None:
    """A whole-array reduction's value, finished by every block from the blocks' partials."""
    o, fn = op.outputs[0].id, REDUCE[op.prim][0]
    ident = REDUCE[op.prim][1]["float"]
    w(f"float v{o};")
    w("{")
    w(f"  float t = {ident};")
    w(f"  for (int b = tid; b < gridDim.x; b += BLOCK) t = {fn}(t, js_ws[{offset} + b]);")
    w(f"  t = js_group_reduce<32>(t, {fn});")
    w("  if ((tid & 31) == 0) js_scr[tid >> 5] = t;")
    w("  __syncthreads();")
    w(f"  t = js_scr[0]; for (int j = 1; j < BLOCK / 32; ++j) t = {fn}(t, js_scr[j]);")
    w(f"  v{o} = t;")
    w("  __syncthreads();")
    w("}")


def _column_finish(k: Kernel, w: Writer, shared: Writer, col_ops, col_epi, offsets: dict) -> None:
    """The column reductions finished and the column epilogue's ops and stores: a block finishes a
    group of G columns (planner.column_group), its threads striding over the blocks' partials rows,
    then combining in a fixed tree (lanes, then warps through shared memory), so every block of the
    grid reads at once and the order is fixed. The strided loop is unrolled so that a thread's loads
    are in flight together (the order of its sum stays)."""
    layout = k.layout
    G = k.plan.col_group
    shared(f"__shared__ float js_colred[{len(col_ops)}][BLOCK / 32][{G}];")
    w(f"for (int cg = blockIdx.x * {G}; cg < N_COLS; cg += gridDim.x * {G}) {{")
    inner = Writer(w.indent + 1)
    inner(f"const int c = cg + tid % {G};")
    for i, op in enumerate(col_ops):
        o, fn = op.outputs[0].id, REDUCE[op.prim][0]
        ident = REDUCE[op.prim][1]['float']
        inner(f"float v{o} = {ident};")
        inner("if (c < N_COLS) {")
        inner("#pragma unroll 4")
        inner(f"  for (int b = tid / {G}; b < gridDim.x; b += BLOCK / {G}) "
              f"v{o} = {fn}(v{o}, js_ws[{offsets[o]} + (long long)b * N_COLS + c]);")
        inner("}")
        inner(f"for (int d = {G}; d < 32; d *= 2) v{o} = {fn}(v{o}, __shfl_xor_sync(0xffffffffu, v{o}, d));")
        inner(f"if ((tid & 31) < {G}) js_colred[{i}][tid >> 5][tid & 31] = v{o};")
    inner("__syncthreads();")
    for i, op in enumerate(col_ops):
        o, fn = op.outputs[0].id, REDUCE[op.prim][0]
        inner(f"v{o} = js_colred[{i}][0][tid % {G}];")
        inner(f"for (int j = 1; j < BLOCK / 32; ++j) v{o} = {fn}(v{o}, js_colred[{i}][j][tid % {G}]);")
    inner("__syncthreads();  // before js_colred is written again")
    inner(f"if (tid >= {G} || c >= N_COLS) continue;")
    for op in col_epi:
        k.emit_op(inner, op)
    for j, v in enumerate(k.outputs):
        if layout.of(v).level == EPILOGUE and layout.of(v).storage == COL:
            put = f"js_io<{STYPE[v.dtype]}>::put({k.ref(v, stored=True)})"
            if layout.of(v).declared == FULL:  # column values broadcast over the rows
                inner(f"for (long long r = 0; r < N_ROWS; ++r) out{j}[r * N_COLS + c] = {put};")
            else:
                inner(f"out{j}[c] = {put};")
    w.lines.extend(inner.lines)
    w("}")
