"""Our kernel as XLA's own kernel call (`__gpu$xla.gpu.ptx`) instead of a call to our FFI launcher.

Why: XLA records an FFI call into its command buffers (CUDA graphs) by tracing the handler on a
capture stream, again each time it updates a graph, and launches it outside graphs through the
handler; a kernel call is a kernel node like XLA's own fusions. The host's time a BERT step
measured 12.4 ms with one step in flight and 17.2 ms with several (ours) against 14.7 and 13.3 for
jax.jit's (docs/perf_notes.md, session 37): steps in flight cost ours more.

What it cannot do, so such launches stay with the launcher (`unsupported` says which): a grid
barrier (no cooperative launch), a row count read at run time (shape families and their
alternatives), a workspace, the poison testing aid, and the remote kernels' table of pointers.
XLA passes the buffers only, operands then results, so the kernel is compiled with its row count
fixed (JS_FIXED_ROWS, csrc_templates/stitch_common.cuh), to PTX: the call takes PTX (its `cubin`
kind is parsed but refused by jaxlib 0.11.2's emitter), which the driver then compiles when XLA
loads it, so the driver must know NVRTC's PTX version (scripts/xla_kernels_check.sh prints both).
"""
from __future__ import annotations

TARGET = "__gpu$xla.gpu.ptx"


def fixed_rows_source(source: str, rows: int) -> str:
    """`source` with its row count a constant instead of a parameter."""
    return f"#define JS_FIXED_ROWS {int(rows)}\n{source}"


def unsupported(launch, remote: bool) -> str | None:
    """Why `launch` (lowering/primitive.py Launch) needs our launcher, or None."""
    reasons = (
        (remote, "a remote kernel takes a table of pointers"),
        (launch.cooperative, "a grid barrier needs a cooperative launch"),
        (launch.rows_buffer >= 0 or launch.rows_per_block > 0 or launch.alternatives,
         "the row count is read at run time"),
        (launch.workspace_bytes > 0, "a workspace"),
        (launch.poison, "poisoned results"),
        (launch.buffers >= 0, "the kernel takes some of the buffers only"),
        (launch.grid < 1, "an empty grid"),
    )
    return next((why for bad, why in reasons if bad), None)


def _mlir_string(text: str) -> str:
    """`text` as an MLIR string literal."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif " " <= ch <= "~":
            out.append(ch)
        else:
            out.append("\\%02X" % ord(ch))  # (PTX is ASCII; tabs and the like)
    return '"' + "".join(out) + '"'


def backend_config(ptx: str, kernel: str, grid: int, block: int, smem: int) -> str:
    """The call's backend config: an MLIR dictionary that XLA parses (xla/service/gpu/kernel_call)."""
    fields = [("name", _mlir_string(kernel)), ("kernel_type", '"ptx"'), ("kernel_data", _mlir_string(ptx)),
              ("grid_x", grid), ("grid_y", 1), ("grid_z", 1), ("block_x", block), ("block_y", 1),
              ("block_z", 1), ("shared_mem_bytes", smem)]
    return "{" + ", ".join(f"{k} = {v}" for k, v in fields) + "}"
