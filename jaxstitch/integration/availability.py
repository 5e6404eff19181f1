"""Whether `jaxstitch.jit` can run its kernels here; where it cannot, why and the command that fixes it.

Each reason is said once a process on the `jaxstitch` logger: as a WARNING where something is missing
(a CUDA jaxlib on a machine with an NVIDIA GPU, the launcher extension, NVRTC), as an INFO line on a
machine with no NVIDIA GPU, where `jaxstitch.jit` being `jax.jit` is expected. Only public jax APIs,
files and package metadata are read: no CUDA library is loaded to find out whether a GPU is there.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import re
import shlex
import threading
import urllib.parse
from importlib import metadata

from ..core import targets
from ..kernels import nvrtc
from . import devices, ffi

log = logging.getLogger("jaxstitch")

# What each of jax's CUDA lines needs: jax's CUDA plugin and an NVRTC of the same CUDA major version.
# pyproject.toml's extras cuda12 / cuda13 list the same (tests/test_install.py holds them equal).
CUDA_LINES = {
    "12": ("jax[cuda12]>=0.6", "cuda-bindings>=12.9,<13", "nvidia-cuda-nvrtc-cu12>=12.1,<13"),
    "13": ("jax[cuda13]>=0.7.2", "cuda-bindings>=13,<14", "nvidia-cuda-nvrtc>=13,<14"),
}
CPU_PLANNING = ("cuda-bindings>=13,<14", "nvidia-cuda-nvrtc>=13,<14")  # the extra `cuda`
CUDA13_DRIVER = 580  # the first driver branch that runs CUDA 13 (CUDA 12 needs 525)

# Files an NVIDIA driver with a GPU leaves: device nodes, the driver's list of GPUs, WSL2's bridge.
DEVICE_NODES = "/dev/nvidia[0-9]*"
PROC_GPUS = "/proc/driver/nvidia/gpus"
PROC_VERSION = "/proc/driver/nvidia/version"
WSL_GPU = ("/dev/dxg", "/usr/lib/wsl/lib/libcuda.so")

_lock = threading.Lock()
_said: set[str] = set()


def usable_target(given: targets.Target | None) -> targets.Target | None:
    """The GPU `jaxstitch.jit` plans for, `given` or the local one; None where it must be plain
    `jax.jit` here, after saying why. A named target on a CPU only needs NVRTC (planning); with a
    GPU that jax sees, the launcher runs the kernels too."""
    gpu_here = nvidia_gpu_present()
    seen = devices.detect() if given is None or gpu_here else None
    if seen is None and gpu_here:
        _say_once("cpu-jaxlib", logging.WARNING, _cpu_jaxlib_message)
    if given is None and seen is None:
        if not gpu_here:
            _say_once("no-gpu", logging.INFO, lambda: "no CUDA GPU found; jaxstitch.jit is jax.jit here")
        return None
    if seen is not None:
        ok, why = ffi.register()
        if not ok:
            _say_once("launcher", logging.WARNING, lambda: _launcher_message(why))
            return None
    why = nvrtc.unavailable_reason()
    if why is not None:
        _say_once("nvrtc", logging.WARNING, lambda: _nvrtc_message(why))
        return None
    return given or seen


def nvidia_gpu_present() -> bool:
    """An NVIDIA driver shows a GPU on this machine, whatever jax sees (file checks only)."""
    if glob.glob(DEVICE_NODES):
        return True
    try:
        if os.listdir(PROC_GPUS):
            return True
    except OSError:
        pass
    return all(os.path.exists(p) for p in WSL_GPU)


def driver_version() -> int | None:
    """The NVIDIA kernel driver's major version (e.g. 580), from /proc; None without one."""
    try:
        with open(PROC_VERSION) as f:
            text = f.read()
    except OSError:
        return None
    m = re.search(r"\s(\d{3,})\.\d+", text)
    return int(m.group(1)) if m else None


def jax_cuda_plugin() -> str | None:
    """The installed jax CUDA plugin's distribution name (jax-cuda13-plugin, ...), or None."""
    for line in sorted(CUDA_LINES, reverse=True):
        for dist in (f"jax-cuda{line}-plugin", f"jax-cuda{line}-pjrt"):
            try:
                metadata.version(dist)
                return dist
            except metadata.PackageNotFoundError:
                continue
    return None


def cuda_line() -> str | None:
    """The CUDA major version ("12", "13") to install for: the jax plugin's, else the driver's."""
    plugin = jax_cuda_plugin()
    if plugin is not None:
        return re.search(r"cuda(\d+)", plugin).group(1)
    driver = driver_version()
    if driver is None:
        return None
    return "13" if driver >= CUDA13_DRIVER else "12"


def pip_command(packages) -> str:
    return "pip install " + " ".join(shlex.quote(p) for p in packages)


def _cpu_jaxlib_message() -> str:
    line = cuda_line() or "13"
    driver = driver_version()
    where = f"this machine has an NVIDIA GPU (driver {driver or 'unknown'})"
    plugin = jax_cuda_plugin()
    if plugin is not None:
        return (f"{where} and {plugin} is installed, but jax found no usable CUDA device (see jax's "
                "warning: driver too old for this CUDA, CUDA_VISIBLE_DEVICES, JAX_PLATFORMS); "
                "jaxstitch.jit runs as jax.jit on the CPU")
    return (f"{where} but jax has no CUDA backend (a CPU-only jaxlib), so jaxstitch.jit runs as jax.jit "
            f"on the CPU; install jax's CUDA {line} line and its NVRTC: {pip_command(CUDA_LINES[line])} "
            f"(jaxstitch's extra cuda{line}; CUDA 13 needs driver >= {CUDA13_DRIVER}, CUDA 12 >= 525)")


def _launcher_message(why: str | None) -> str:
    return (f"the kernel launcher is unavailable ({why}), so jaxstitch.jit runs as jax.jit; rebuild it "
            f"with a C++17 compiler (e.g. g++) and the jaxlib in use: {_reinstall_command()}")


def _nvrtc_message(why: str) -> str:
    line = cuda_line()
    packages = CUDA_LINES[line][1:] if line else CPU_PLANNING
    why = why.removesuffix("; " + nvrtc.INSTALL_HINT)  # (the command below fits this machine)
    which = f"jaxstitch's extra cuda{line}" if line else "jaxstitch's extra cuda, for planning on a CPU"
    return (f"{why}, so jaxstitch.jit runs as jax.jit (no kernel can be compiled); "
            f"install it: {pip_command(packages)} ({which})")


def _reinstall_command() -> str:
    """pip's command to build jaxstitch again from the source tree it was installed from."""
    command = "pip install --no-build-isolation --no-deps --force-reinstall "
    try:
        info = json.loads(metadata.distribution("jaxstitch").read_text("direct_url.json") or "{}")
    except (metadata.PackageNotFoundError, ValueError):
        info = {}
    url = info.get("url", "")
    if url.startswith("file://") and "dir_info" in info:
        editable = "-e " if info["dir_info"].get("editable") else ""
        return command + editable + shlex.quote(urllib.parse.unquote(url[len("file://"):]))
    return command + "-e <jaxstitch's source tree>"


def _say_once(key: str, level: int, message) -> None:
    """Logs `message()` the first time `key` comes (built only then: it reads package metadata)."""
    with _lock:
        if key in _said:
            return
        _said.add(key)
    log.log(level, message())
