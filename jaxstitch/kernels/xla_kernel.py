"""Our kernel as XLA's own kernel call (`__gpu$xla.gpu.ptx`) instead of a call to our FFI launcher.

Why: XLA records an FFI call into its command buffers (CUDA graphs) by tracing the handler on a
capture stream, again each time it updates a graph, and launches it outside graphs through the
handler; a kernel call is a kernel node like XLA's own fusions. The host's time a BERT step
measured 12.4 ms with one step in flight and 17.2 ms with several (ours) against 14.7 and 13.3 for
jax.jit's (H100): steps in flight cost ours more.

What it cannot do, so such launches stay with the launcher (`unsupported` says which): a grid
barrier (no cooperative launch), a row count read at run time (shape families and their
alternatives), a workspace, the poison testing aid, and the remote kernels' table of pointers.
XLA passes the buffers only, operands then results, so the kernel is compiled with its row count
fixed (JS_FIXED_ROWS, csrc_templates/stitch_common.cuh), to PTX: the call takes PTX (its `cubin`
kind is parsed but refused by jaxlib 0.11.2's emitter), which the driver then compiles when XLA
loads it, so the driver must read NVRTC's PTX version (`for_driver` lowers it where NVRTC is newer;
scripts/xla_kernels_check.sh prints both).
Older XLAs passed a buffer given as two operands once, which would shift the kernel's pointers
(tests/test_gpu_correctness.py::test_xla_kernel_call_with_one_buffer_twice checks the installed one).
"""
from __future__ import annotations

import ctypes
import functools
import re

TARGET = "__gpu$xla.gpu.ptx"
# The newest PTX ISA a driver of each CUDA version reads (CUDA 12.x: 8.x, but 12.6 reads 8.5 and
# 12.8 and 12.9 read 8.7 and 8.8; 13.x: 9.x).
_PTX_ISA = {(12, 0): (8, 0), (12, 1): (8, 1), (12, 2): (8, 2), (12, 3): (8, 3), (12, 4): (8, 4),
            (12, 5): (8, 5), (12, 6): (8, 5), (12, 8): (8, 7), (12, 9): (8, 8)}


@functools.lru_cache(maxsize=1)
def driver_cuda_version() -> tuple[int, int] | None:
    """The CUDA version of the installed driver (cuDriverGetVersion), or None without one."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    v = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(v)) != 0 or v.value <= 0:
        return None
    return v.value // 1000, v.value % 1000 // 10


def readable_isa(cuda: tuple[int, int]) -> tuple[int, int]:
    """The newest PTX ISA version a driver of CUDA version `cuda` reads."""
    if cuda in _PTX_ISA:
        return _PTX_ISA[cuda]
    return (9, cuda[1]) if cuda[0] == 13 else (cuda[0] - 4, cuda[1])


def for_driver(ptx: str, cuda: tuple[int, int] | None) -> str:
    """`ptx` with its `.version` lowered to what a driver of CUDA version `cuda` reads, where NVRTC
    wrote a newer one (NVRTC 13.5 writes 9.5; a CUDA 13.0 driver reads up to 9.0, and refuses a newer
    version outright). Right as long as no instruction needs the newer ISA; the driver says so when
    it loads the PTX (XLA's executable then fails to load: a loud error, not a wrong result)."""
    m = re.search(r"^\.version (\d+)\.(\d+)$", ptx, re.M)
    if cuda is None or m is None:
        return ptx
    have, can = (int(m.group(1)), int(m.group(2))), readable_isa(cuda)
    if have <= can:
        return ptx
    return ptx[:m.start()] + f".version {can[0]}.{can[1]}" + ptx[m.end():]


def fixed_rows_source(source: str, rows: int) -> str:
    """`source` with its row count a constant instead of a parameter."""
    return f"#define JS_FIXED_ROWS {int(rows)}\n{source}"


def unsupported(launch, remote: bool) -> str | None:
    """Why `launch` (integration/primitive.py Launch) needs our launcher, or None."""
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
