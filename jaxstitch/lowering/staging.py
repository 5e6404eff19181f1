"""Row inputs in and out of the block's stash: async copies of the next row group (cp.async), and
this thread's elements of a chunk from the stash or from global memory."""
from __future__ import annotations

from ..core import ir
from ..plan.layout import COL, FULL
from .cuda_ops import STYPE
from .kernel import Kernel, Writer, stash_slot, vec_col


def stash_ptr(k: Kernel, v: ir.Value, offset: int, buf: str = "js_buf") -> str:
    """`v`'s slots in the stash; with a ring of stage buffers, in buffer `buf` (an expression)."""
    at = f"{buf} * {k.plan.stage_bytes} + " if k.m.stages >= 2 else ""
    return f"reinterpret_cast<{STYPE[v.dtype]}*>(js_dyn + {at}{offset})"


def load_chunk(k: Kernel, w: Writer, stash: dict[int, int], first_phase: bool, last_read: bool = False):
    """This thread's elements of the per-chunk inputs: row inputs from the stash when they were staged
    into it, else from global memory in the first phase (copied to the stash when there is one) and
    from the stash after; column inputs (chunked rows only) from global memory, where L1/L2 keep them."""
    for v in k.plan.region.inputs:
        p, i = k.layout.of(v), k.inputs[v.id]
        if p.storage == FULL:
            ptr = f"in{i} + row * N_COLS + ROW_C0"
            if v.id in stash:
                k.load_array(w, v, ptr, per_row=True, stash=stash_ptr(k, v, stash[v.id]),
                             from_stash=k.m.stages > 0 or not first_phase, last_read=last_read)
            else:
                k.load_array(w, v, ptr, per_row=True)
        elif p.storage == COL and k.chunked:
            k.load_array(w, v, f"in{i} + ROW_C0", per_row=False)


def first_row_group(k: Kernel) -> str:
    """This block's first row group (a split row's task: a slice of a row)."""
    return "(long long)blockIdx.x" if k.split else "(long long)blockIdx.x * RPB"


def next_row_group(k: Kernel, ahead: int = 1, base: str = "base") -> str:
    """The row group this block takes `ahead` groups after `base` (the current one by default)."""
    if k.split:
        assert ahead == 1, "split rows are staged one task ahead"
        return f"{base} + js_step"
    step = "(long long)gridDim.x * RPB"
    return f"{base} + {step}" if ahead == 1 else f"{base} + {ahead} * {step}"


def refill_ring(k: Kernel, w: Writer, stash: dict[int, int]):
    """At the loop's top, start the copies of the row group STAGES - 1 ahead into the buffer the
    last row group was read from (the loop's top barrier, where there is one, saw its reads end)."""
    if k.m.stages == 2:  # the other buffer
        w("js_buf ^= 1;")
        stage_rows(k, w, stash, next_row_group(k))
        w("js_buf ^= 1;  // back to this row group's buffer; the loop's end moves on to the next")
    else:
        previous = f"(js_buf == 0 ? {k.m.stages - 1} : js_buf - 1)"
        stage_rows(k, w, stash, next_row_group(k, k.m.stages - 1), buf=previous)


def next_buffer(stages: int) -> str:
    """The statement that moves `js_buf` on to the next row group's buffer."""
    return "js_buf ^= 1;" if stages == 2 else f"js_buf = js_buf == {stages - 1} ? 0 : js_buf + 1;"


def stage_rows(k: Kernel, w: Writer, stash: dict[int, int], base: str, one_chunk: bool = False,
               buf: str = "js_buf"):
    """Start async copies of the row group at `base` into the stash buffer `buf` (this thread's
    slots, every chunk) and commit them as one group; `one_chunk`: only chunk `ch`'s slots, and no
    commit (the caller commits once its chunk loop has staged them all)."""
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
    extents = _prefix_extents(k, w)
    pad = "  " if one_chunk else "    "
    if one_chunk and k.partial_stash:
        w("  if (ch < STASH_CHUNKS)")
    if not one_chunk:
        w("  for (int ch = 0; ch < STASH_CHUNKS; ++ch) {")
    w("#pragma unroll")
    w(f"{pad}for (int k = 0; k < VPT; ++k) {{")
    w(f"{pad}  const int col0 = {vec_col('k')};")
    w(f"{pad}  const bool ok = sok && col0 < scols;")
    for v in k.plan.region.inputs:
        if v.id in stash:
            i = k.inputs[v.id]
            stream = ", true" if k.partial_stash else ""
            ok = f"(ok && sc0 + col0 <= {extents[v.id]})" if v.id in extents else "ok"
            w(f"{pad}  js_stage<{STYPE[v.dtype]}, V{stream}>({stash_slot(stash_ptr(k, v, stash[v.id], buf))}, "
              f"{ok} ? in{i} + srow * N_COLS + sc0 + col0 : in{i}, {ok});")
    w(f"{pad}}}")
    if not one_chunk:
        w("  }")
        w("  js_stage_commit();")
    w("}")


def _prefix_extents(k: Kernel, w: Writer) -> dict[int, str]:
    """For each staged input needed only on a prefix of its rows (plan/prefixes.py), the name of its
    row's last needed column, declared here: copies past it are skipped (zeros are staged)."""
    names, extents = {}, {}
    for p in k.plan.prefixes:
        key = (p.stride, p.size, p.offset)
        if key not in names:
            names[key] = f"sext{len(names)}"
            w(f"  const long long {names[key]} = (srow / {p.stride}) % {p.size} + {p.offset};")
        extents[p.value] = names[key]
    return extents
