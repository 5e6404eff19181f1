"""Content-addressed cubin cache, in memory and on disk.

The key is a hash of everything that decides the bytes: the source, NVRTC's version and options, the
architecture and jaxstitch's version. The same key is the module's name at run time, so a fresh
process with a warm disk cache never runs NVRTC.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import threading
import time

from . import nvrtc

log = logging.getLogger("jaxstitch")
VERSION = "0.1.0"


@dataclasses.dataclass(frozen=True)
class Stats:
    nvrtc_compiles: int
    memory_hits: int
    disk_hits: int
    nvrtc_seconds: float = 0.0   # time in NVRTC, summed over compiles (which may run side by side)


class _Cache:
    def __init__(self):
        self.lock = threading.Lock()
        self.memory: dict[str, tuple[bytes, nvrtc.Resources]] = {}
        self.compiles = self.memory_hits = self.disk_hits = 0
        self.nvrtc_seconds = 0.0
        self.ptx: dict[str, str] = {}


_CACHE = _Cache()
# NVRTC releases the GIL: a program's kernels compile side by side, and beside the planning still
# to do (prefetch). Each key compiles once; a lookup of a key in flight waits for it.
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1),
                                              thread_name_prefix="jaxstitch-nvrtc")
_IN_FLIGHT: dict[str, concurrent.futures.Future] = {}


def cache_key(source: str, arch: str) -> str:
    h = hashlib.sha256()
    for part in (source, nvrtc.version(), " ".join(nvrtc.OPTIONS), arch, VERSION):
        h.update(part.encode())
        h.update(b"\x00")
    return h.hexdigest()


def prefetch(source: str, arch: str, cache_dir: str | None):
    """Starts `get_cubin` in the background; a later get_cubin of the same source waits for it
    (counted once, as the compile or disk hit it was). Errors surface there."""
    key = cache_key(source, arch)
    with _CACHE.lock:
        if key in _CACHE.memory or key in _IN_FLIGHT:
            return
        _IN_FLIGHT[key] = _POOL.submit(_load_or_compile, key, source, arch, cache_dir)


def get_cubin(source: str, arch: str, cache_dir: str | None) -> tuple[str, bytes, nvrtc.Resources]:
    """(key, cubin, resources) for `source`, running NVRTC only on a miss in memory and on disk."""
    key = cache_key(source, arch)
    with _CACHE.lock:
        pending = _IN_FLIGHT.get(key)
    if pending is not None and pending.exception() is None:
        return pending.result()  # (counted as the compile or disk hit it was)
    with _CACHE.lock:
        if key in _CACHE.memory:
            _CACHE.memory_hits += 1
            return (key,) + _CACHE.memory[key]
    return _load_or_compile(key, source, arch, cache_dir)  # (after a failed prefetch: its error, here)


def _load_or_compile(key: str, source: str, arch: str, cache_dir: str | None) -> tuple[str, bytes, nvrtc.Resources]:
    try:
        return _load_or_compile_now(key, source, arch, cache_dir)
    finally:
        with _CACHE.lock:
            _IN_FLIGHT.pop(key, None)


def _load_or_compile_now(key: str, source: str, arch: str, cache_dir: str | None):
    path = _entry(cache_dir, key)
    if path and os.path.exists(path + ".cubin") and os.path.exists(path + ".json"):
        with open(path + ".cubin", "rb") as f:
            cubin = f.read()
        with open(path + ".json") as f:
            res = nvrtc.Resources(**json.load(f))
        if res.registers == 0:  # written where the log lacked ptxas's report (nvrtc.cubin_resources)
            res = nvrtc.cubin_resources(cubin) or res
        with _CACHE.lock:
            _CACHE.disk_hits += 1
            _CACHE.memory[key] = (cubin, res)
        return key, cubin, res
    t0 = time.perf_counter()
    cubin, res = nvrtc.compile_cubin(source, arch)
    with _CACHE.lock:
        _CACHE.compiles += 1
        _CACHE.nvrtc_seconds += time.perf_counter() - t0
        _CACHE.memory[key] = (cubin, res)
    if path:
        _write_atomic(path + ".cubin", cubin)
        _write_atomic(path + ".json", json.dumps(dataclasses.asdict(res)).encode())
    return key, cubin, res


def get_ptx(source: str, arch: str, cache_dir: str | None) -> str:
    """PTX of `source` for `arch`'s virtual architecture (kernels/xla_kernel.py), cached like cubins."""
    key = cache_key(source, arch + ":ptx")
    with _CACHE.lock:
        if key in _CACHE.ptx:
            return _CACHE.ptx[key]
    path = _entry(cache_dir, key)
    if path and os.path.exists(path + ".ptx"):
        with open(path + ".ptx") as f:
            ptx = f.read()
    else:
        ptx = nvrtc.compile_ptx(source, arch)
        if path:
            _write_atomic(path + ".ptx", ptx.encode())
    with _CACHE.lock:
        _CACHE.ptx[key] = ptx
    return ptx


def _entry(cache_dir: str | None, key: str) -> str | None:
    """Where a key's files live on disk (suffixes added by kind), or None without a cache directory."""
    return os.path.join(cache_dir, key[:2], key) if cache_dir else None


def _write_atomic(path: str, data: bytes):
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache directory costs recompiles, never a failure
        log.warning("could not write the kernel cache at %s: %s", path, e)


def stats() -> Stats:
    with _CACHE.lock:
        return Stats(_CACHE.compiles, _CACHE.memory_hits, _CACHE.disk_hits, _CACHE.nvrtc_seconds)


def clear_memory():
    with _CACHE.lock:
        _CACHE.memory.clear()
        _CACHE.ptx.clear()
