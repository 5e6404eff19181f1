"""CUDA C to cubin with NVRTC. Needs no GPU, so every generated kernel also compiles in CI."""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import re
import struct
import time

OPTIONS = ("-std=c++17", "--fmad=true", "-default-device")


class CompileError(RuntimeError):
    """NVRTC rejected a kernel (the message holds its log), or NVRTC is not installed."""


class CompileTimeout(CompileError):
    """NVRTC was cancelled at its time limit (config.Config.nvrtc_seconds)."""

    def __init__(self, seconds: float):
        super().__init__(f"NVRTC did not finish within {seconds:g} s (JAXSTITCH_NVRTC_SECONDS)")
        self.seconds = seconds


# nvrtcSetFlowCallback's callback: int (*)(void *payload, void *reserved), 1 to cancel the compile
_FLOW_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


# What installs NVRTC: the extra of jax's CUDA line (pyproject.toml; integration/availability.py says
# which one fits this machine).
INSTALL_HINT = ("pip install 'jaxstitch[cuda13]' or 'jaxstitch[cuda12]' (the CUDA line of your jaxlib), "
                "or on a CPU-only machine 'jaxstitch[cuda]'")


@functools.lru_cache(maxsize=1)
def _nvrtc():
    """cuda.bindings' NVRTC module, with its library loaded: the import alone succeeds without
    libnvrtc (cuda.bindings looks for it, in the NVIDIA wheels first, at the first call)."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:
        raise CompileError(f"NVRTC is not available: cuda.bindings is not installed ({e}); "
                           f"{INSTALL_HINT}") from e
    try:
        err, _, _ = nvrtc.nvrtcVersion()
    except (RuntimeError, OSError) as e:  # the library was not found or did not load
        raise CompileError(f"NVRTC is not available: cuda.bindings found no libnvrtc ({str(e).strip()}); "
                           f"{INSTALL_HINT}") from e
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"NVRTC is not available: nvrtcVersion returned {err}; {INSTALL_HINT}")
    return nvrtc


def version() -> str:
    try:
        err, major, minor = _nvrtc().nvrtcVersion()
    except CompileError:
        return "none"
    return f"{major}.{minor}"


def available() -> bool:
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why NVRTC cannot compile here (with the command that installs it), or None when it can."""
    try:
        _nvrtc()
        return None
    except CompileError as e:
        return str(e)


@dataclasses.dataclass(frozen=True)
class Resources:
    """ptxas's resource report for the kernel."""

    registers: int
    spill_bytes: int   # spill stores + loads
    stack_bytes: int


def resources(log: str) -> Resources:
    def grab(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0
    return Resources(grab(r"Used (\d+) registers"),
                     grab(r"(\d+) bytes spill stores") + grab(r"(\d+) bytes spill loads"),
                     grab(r"(\d+) bytes stack frame"))


# Attributes of a cubin's `.nv.info` section (ELF): the kernel's registers and its stack frame.
_EIATTR_MAX_STACK_SIZE, _EIATTR_REGCOUNT = 0x11, 0x2F


def cubin_resources(cubin: bytes) -> Resources | None:
    """The registers and stack frame the cubin records for its kernel (one kernel a cubin), or None
    if it records none. The stack frame stands in for the spills: our kernels keep no local arrays.
    Why: on the GPU machines (NVRTC 13.0) the program log sometimes lacked ptxas's report, and a
    kernel then read as 0 registers and no spills (DIEN's tile grid sized for 12 blocks an SM where 9
    fit), or reported another kernel's numbers."""
    try:
        shoff, = struct.unpack_from("<Q", cubin, 0x28)
        entsize, count, strndx = struct.unpack_from("<HHH", cubin, 0x3A)
        headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize) for i in range(count)]
        names = headers[strndx][4]
        info = next(cubin[h[4]:h[4] + h[5]] for h in headers
                    if cubin[names + h[0]:cubin.index(b"\0", names + h[0])] == b".nv.info")
    except (struct.error, StopIteration, ValueError, IndexError):
        return None
    attrs, i = {}, 0
    while i + 4 <= len(info):
        fmt, attr, size = info[i], info[i + 1], struct.unpack_from("<H", info, i + 2)[0]
        if fmt == 0x04:  # a value of `size` bytes: (symbol, value) for these two
            if attr in (_EIATTR_REGCOUNT, _EIATTR_MAX_STACK_SIZE) and size == 8:
                attrs[attr] = struct.unpack_from("<I", info, i + 8)[0]
            i += 4 + size
        else:
            i += 4 if fmt in (0x02, 0x03) else 2
    if _EIATTR_REGCOUNT not in attrs:
        return None
    stack = attrs.get(_EIATTR_MAX_STACK_SIZE, 0)
    return Resources(attrs[_EIATTR_REGCOUNT], stack, stack)


def _resources(log: str, cubin: bytes) -> Resources:
    """What the cubin records, with the log's spill bytes where the log reports the same kernel
    (the same registers): the cubin is what runs."""
    reported, recorded = resources(log), cubin_resources(cubin)
    if recorded is None:
        return reported
    if reported.registers == recorded.registers:
        return dataclasses.replace(recorded, spill_bytes=reported.spill_bytes)
    return recorded


@contextlib.contextmanager
def _compiled(source: str, arch: str, extra: tuple[str, ...], name: str, seconds: float | None = None):
    """(nvrtc, program) of `source` compiled for `--gpu-architecture=arch`, destroyed on exit;
    cancelled after `seconds` (None or 0: no limit) with CompileTimeout."""
    nvrtc = _nvrtc()
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    _check(nvrtc, err, "nvrtcCreateProgram")
    try:
        callback = _cancel_after(nvrtc, prog, seconds)  # (kept alive until the compile returns)
        opts = [f"--gpu-architecture={arch}".encode()] + [o.encode() for o in OPTIONS + extra]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if callback is not None and getattr(err, "name", "") == "NVRTC_ERROR_CANCELLED":
            raise CompileTimeout(seconds)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC failed for {arch}:\n{_log(nvrtc, prog)}")
        yield nvrtc, prog
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _cancel_after(nvrtc, prog, seconds: float | None):
    """A flow callback that cancels `prog`'s compile once `seconds` have passed, installed; None
    without a limit or where this NVRTC has no flow callbacks. NVRTC calls it thousands of times a
    second but honours a cancel only between its phases: a 10,000-line kernel (a data-parallel BERT
    step's random-bit region) that takes 90 s in full stopped after 33-44 s under a limit of 10 or
    20 s, and under 5 s at 5.1 s. The slowest of BERT's stitched kernels takes 1 s."""
    if not seconds or not hasattr(nvrtc, "nvrtcSetFlowCallback"):
        return None
    end = time.monotonic() + seconds
    callback = _FLOW_CALLBACK(lambda payload, reserved: int(time.monotonic() > end))
    (err,) = nvrtc.nvrtcSetFlowCallback(prog, ctypes.cast(callback, ctypes.c_void_p).value, 0)
    return callback if err == nvrtc.nvrtcResult.NVRTC_SUCCESS else None


def compile_cubin(source: str, arch: str, name: str = "kernel.cu", *,
                  seconds: float | None = None) -> tuple[bytes, Resources]:
    """(cubin, ptxas's resources) of `source`; CompileTimeout past `seconds`."""
    with _compiled(source, arch, ("--ptxas-options=-v",), name, seconds) as (nvrtc, prog):
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(nvrtc, err, "nvrtcGetCUBINSize")
        buf = bytearray(size)
        (err,) = nvrtc.nvrtcGetCUBIN(prog, buf)
        _check(nvrtc, err, "nvrtcGetCUBIN")
        return bytes(buf), _resources(_log(nvrtc, prog), bytes(buf))


def compile_ptx(source: str, arch: str, name: str = "kernel.cu") -> str:
    """PTX of `source` for the virtual architecture of `arch` ("sm_90" -> compute_90): what XLA's own
    kernel call takes (kernels/xla_kernel.py), which XLA then assembles with its ptxas."""
    with _compiled(source, arch.replace("sm_", "compute_", 1), (), name) as (nvrtc, prog):
        err, size = nvrtc.nvrtcGetPTXSize(prog)
        _check(nvrtc, err, "nvrtcGetPTXSize")
        buf = bytearray(size)
        (err,) = nvrtc.nvrtcGetPTX(prog, buf)
        _check(nvrtc, err, "nvrtcGetPTX")
        return bytes(buf).decode().rstrip("\x00")


def _log(nvrtc, prog) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    buf = bytearray(size)
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return bytes(buf).decode(errors="replace").rstrip("\x00")


def _check(nvrtc, err, what):
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{what} failed: {err}")
