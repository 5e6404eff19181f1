"""CUDA C to cubin with NVRTC. Needs no GPU, so every generated kernel also compiles in CI."""
from __future__ import annotations

import dataclasses
import functools
import re

OPTIONS = ("-std=c++17", "--fmad=true", "-default-device")


class CompileError(RuntimeError):
    """NVRTC rejected a kernel (the message holds its log), or NVRTC is not installed."""


@functools.lru_cache(maxsize=1)
def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise CompileError("NVRTC is not available: pip install 'jaxstitch[cuda]' "
                           "(cuda-bindings and nvidia-cuda-nvrtc)") from e
    return nvrtc


def version() -> str:
    try:
        err, major, minor = _nvrtc().nvrtcVersion()
    except CompileError:
        return "none"
    return f"{major}.{minor}"


def available() -> bool:
    try:
        _nvrtc()
        return True
    except CompileError:
        return False


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


def compile_cubin(source: str, arch: str, name: str = "kernel.cu") -> tuple[bytes, Resources]:
    nvrtc = _nvrtc()
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    _check(nvrtc, err, "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode()] + [o.encode() for o in OPTIONS + ("--ptxas-options=-v",)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC failed for {arch}:\n{_log(nvrtc, prog)}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(nvrtc, err, "nvrtcGetCUBINSize")
        buf = bytearray(size)
        (err,) = nvrtc.nvrtcGetCUBIN(prog, buf)
        _check(nvrtc, err, "nvrtcGetCUBIN")
        return bytes(buf), resources(_log(nvrtc, prog))
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _log(nvrtc, prog) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    buf = bytearray(size)
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return bytes(buf).decode(errors="replace").rstrip("\x00")


def _check(nvrtc, err, what):
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{what} failed: {err}")
