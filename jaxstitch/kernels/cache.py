"""Content-addressed cubin cache, in memory and on disk.

The key is a hash of everything that decides the bytes: the source up to the names of its values
(`canonical`: the regions of a model's identical layers are one kernel under different names, and
compile once), NVRTC's version and options, the architecture and jaxstitch's version. The same key
is the module's name at run time, so a fresh process with a warm disk cache never runs NVRTC.

On disk an entry is two files under `<cache_dir>/<key[:2]>/`: the data (`<key>.cubin` or `<key>.ptx`)
and `<key>.json`, its metadata with the data's sha256. Each is written to a temporary file in the same
directory and renamed into place (atomic on POSIX), the data first: a `.json` present means its data
was complete when written, and processes writing the same key at once leave one of their (identical)
copies. An entry that fails its checks (unreadable JSON, a sha256 that does not match, a cubin that is
not an ELF file) is reported once with its path, deleted and compiled again. The directory is bounded
(config.Config.cache_max_bytes): a write that takes it past the bound deletes the entries used least
recently (by mtime, which a disk hit refreshes) down to 90% of it.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time

from ..core import config
from . import nvrtc

log = logging.getLogger("jaxstitch")
VERSION = "0.1.0"
FORMAT = 2          # the .json's layout: {"format", "sha256", "bytes", "resources" (cubins)}
EVICT_TO = 0.9      # a write past the bound evicts down to this share of it (not again at the next write)
STALE_TEMP_S = 3600.0  # a temporary file this old was left by a process that died mid-write
_ENTRY_FILE = re.compile(r"[0-9a-f]{64}(?:\.timeout)?\.(cubin|ptx|json|txt)")


@dataclasses.dataclass(frozen=True)
class Stats:
    nvrtc_compiles: int
    memory_hits: int
    disk_hits: int
    nvrtc_seconds: float = 0.0       # time in NVRTC, summed over compiles (which may run side by side)
    nvrtc_busy_seconds: float = 0.0  # wall time during which at least one NVRTC compile ran
    discarded: int = 0               # disk entries that failed their checks and were compiled again


class _Cache:
    def __init__(self):
        self.lock = threading.Lock()
        self.memory: dict[str, tuple[bytes, nvrtc.Resources]] = {}
        self.compiles = self.memory_hits = self.disk_hits = self.discarded = 0
        self.nvrtc_seconds = self.busy_seconds = 0.0
        self.running = 0            # NVRTC compiles running now
        self.busy_since = 0.0       # when `running` last went from 0 to 1
        self.pending = 0            # lookups asked for (prefetched or waited on) and not yet done
        self.ptx: dict[str, str] = {}
        self.timeouts: dict[str, float] = {}  # key -> the time limit NVRTC did not finish it within
        self.warned: set[str] = set()         # entries reported corrupt, and unwritable directories
        self.disk_bytes: dict[str, int] = {}  # cache_dir -> its size as last counted, plus our writes


_CACHE = _Cache()
_DISK_LOCK = threading.Lock()  # one eviction at a time (a scan of the whole directory)
# NVRTC releases the GIL: a program's kernels compile side by side, and beside the planning still
# to do (prefetch). Each key compiles once; a lookup of a key in flight waits for it.
THREADS = min(16, os.cpu_count() or 1)
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="jaxstitch-nvrtc")
_IN_FLIGHT: dict[str, concurrent.futures.Future] = {}


class _Corrupt(Exception):
    """A disk entry that fails its checks (the message says which)."""


# The prefixes of the names code generation gives values, stages and accumulators, each followed by a
# value id (v12, a8105, p3_1, sc4): the only text in which two regions of identical layers differ.
ID_NAMED = frozenset({"v", "s", "p", "q", "r", "t", "a", "sc", "x"})
_TOKENS = re.compile(r'"(?:[^"\\\n]|\\.)*"|\b[A-Za-z_]\w*\b')
_NUMBERED = re.compile(r"([A-Za-z_]+?)(\d+)(_\w*)?")


HELPERS_END = "// ---- end of the common helpers"  # (csrc_templates/stitch_common.cuh's last line)


def canonical(source: str) -> str:
    """`source` with the ids in its value names renumbered by first appearance, below the common
    helpers (whose own locals, `v2` among them, are no value's) and outside strings. A bijective
    renaming of the names the generated code declares (nothing is token-pasted), so two sources
    with one canonical form are one kernel: BERT's bfloat16 train step plans 100 kernels of 12
    canonical forms, and each source compiles to the cubin bytes of the others of its form."""
    at = source.find(HELPERS_END)
    head, body = (source[:at], source[at:]) if at >= 0 else ("", source)
    names: dict[tuple[str, str], str] = {}
    counts: dict[str, int] = {}

    def rename(m: re.Match) -> str:
        token = m.group(0)
        numbered = None if token.startswith('"') else _NUMBERED.fullmatch(token)
        if numbered is None or numbered.group(1) not in ID_NAMED:
            return token
        prefix, vid, rest = numbered.group(1), numbered.group(2), numbered.group(3) or ""
        if (prefix, vid) not in names:
            names[prefix, vid] = f"{prefix}{counts.get(prefix, 0)}"
            counts[prefix] = counts.get(prefix, 0) + 1
        return names[prefix, vid] + rest
    return head + _TOKENS.sub(rename, body)


def cache_key(source: str, arch: str) -> str:
    h = hashlib.sha256()
    for part in (canonical(source), nvrtc.version(), " ".join(nvrtc.OPTIONS), arch, VERSION):
        h.update(part.encode())
        h.update(b"\x00")
    return h.hexdigest()


def prefetch(source: str, arch: str, cache_dir: str | None, seconds: float | None = None):
    """Starts `get_cubin` in the background; a later get_cubin of the same source waits for it
    (counted once, as the compile or disk hit it was). Errors surface there."""
    key = cache_key(source, arch)
    with _CACHE.lock:
        if key in _CACHE.memory or key in _IN_FLIGHT:
            return
        _CACHE.pending += 1
        _IN_FLIGHT[key] = _POOL.submit(_load_or_compile, key, source, arch, cache_dir, seconds)


def get_cubin(source: str, arch: str, cache_dir: str | None,
              seconds: float | None = None) -> tuple[str, bytes, nvrtc.Resources]:
    """(key, cubin, resources) for `source`, running NVRTC only on a miss in memory and on disk;
    nvrtc.CompileTimeout where NVRTC did not finish within `seconds` (None or 0: no limit), now or
    in an earlier compile under the same or a larger limit (remembered in memory and on disk, so a
    runaway kernel costs its limit once per cache directory)."""
    key = cache_key(source, arch)
    with _CACHE.lock:
        pending = _IN_FLIGHT.get(key)
    if pending is not None and pending.exception() is None:
        return pending.result()  # (counted as the compile or disk hit it was)
    with _CACHE.lock:
        if key in _CACHE.memory:
            _CACHE.memory_hits += 1
            return (key,) + _CACHE.memory[key]
        _CACHE.pending += 1
    return _load_or_compile(key, source, arch, cache_dir, seconds)  # (after a failed prefetch: its error)


def _load_or_compile(key: str, source: str, arch: str, cache_dir: str | None,
                     seconds: float | None) -> tuple[str, bytes, nvrtc.Resources]:
    try:
        return _load_or_compile_now(key, source, arch, cache_dir, seconds)
    finally:
        with _CACHE.lock:
            _IN_FLIGHT.pop(key, None)
            _CACHE.pending -= 1


def _load_or_compile_now(key: str, source: str, arch: str, cache_dir: str | None, seconds: float | None):
    path = _entry(cache_dir, key)
    found = _load(path, ".cubin", cache_dir)
    if found is not None:
        cubin, meta = found
        res = nvrtc.Resources(**meta["resources"])
        if res.registers == 0:  # written where the log lacked ptxas's report (nvrtc.cubin_resources)
            res = nvrtc.cubin_resources(cubin) or res
        with _CACHE.lock:
            _CACHE.disk_hits += 1
            _CACHE.memory[key] = (cubin, res)
        return key, cubin, res
    _raise_if_timed_out(key, path, cache_dir, seconds)  # (only where NVRTC would run)
    try:
        cubin, res = _timed(functools.partial(nvrtc.compile_cubin, seconds=seconds), source, arch)
    except nvrtc.CompileTimeout as e:
        with _CACHE.lock:
            _CACHE.timeouts[key] = e.seconds
        if path:
            _store(path + TIMED_OUT, ".txt", b"", {"seconds": e.seconds}, cache_dir)
        raise
    with _CACHE.lock:
        _CACHE.memory[key] = (cubin, res)
    if path:
        _store(path, ".cubin", cubin, {"resources": dataclasses.asdict(res)}, cache_dir)
    return key, cubin, res


TIMED_OUT = ".timeout"  # (beside a key's entry: the limit NVRTC did not finish its source within)


def _raise_if_timed_out(key: str, path: str | None, cache_dir: str | None, seconds: float | None):
    """CompileTimeout where NVRTC ran out of a limit at least `seconds` on this key before."""
    if not seconds:
        return
    with _CACHE.lock:
        limit = _CACHE.timeouts.get(key)
    if limit is None and path:
        found = _load(path + TIMED_OUT, ".txt", cache_dir)
        limit = found[1].get("seconds") if found is not None else None
    if isinstance(limit, (int, float)) and seconds <= limit:
        raise nvrtc.CompileTimeout(limit)


def _timed(compile_fn, source: str, arch: str):
    """compile_fn(source, arch), counted among NVRTC's compiles, its time and its busy wall time."""
    with _CACHE.lock:
        if _CACHE.running == 0:
            _CACHE.busy_since = time.perf_counter()
        _CACHE.running += 1
    t0 = time.perf_counter()
    try:
        return compile_fn(source, arch)
    finally:
        t1 = time.perf_counter()
        with _CACHE.lock:
            _CACHE.running -= 1
            _CACHE.compiles += 1
            _CACHE.nvrtc_seconds += t1 - t0
            if _CACHE.running == 0:
                _CACHE.busy_seconds += t1 - _CACHE.busy_since


def get_ptx(source: str, arch: str, cache_dir: str | None) -> str:
    """PTX of `source` for `arch`'s virtual architecture (kernels/xla_kernel.py), cached like cubins."""
    key = cache_key(source, arch + ":ptx")
    with _CACHE.lock:
        if key in _CACHE.ptx:
            return _CACHE.ptx[key]
    path = _entry(cache_dir, key)
    found = _load(path, ".ptx", cache_dir)
    if found is not None:
        ptx = found[0].decode()
    else:
        ptx = nvrtc.compile_ptx(source, arch)
        if path:
            _store(path, ".ptx", ptx.encode(), {}, cache_dir)
    with _CACHE.lock:
        _CACHE.ptx[key] = ptx
    return ptx


def _entry(cache_dir: str | None, key: str) -> str | None:
    """Where a key's files live on disk (suffixes added by kind), or None without a cache directory."""
    return os.path.join(cache_dir, key[:2], key) if cache_dir else None


def _load(path: str | None, suffix: str, cache_dir: str | None) -> tuple[bytes, dict] | None:
    """(data, metadata) of the entry at `path`, its use time refreshed; None on a miss. An entry that
    fails its checks is reported (once per path), deleted and counted, and reads as a miss."""
    if not path:
        return None
    try:
        found = _read_entry(path, suffix)
    except _Corrupt as e:
        _discard(path, suffix, str(e), cache_dir)
        return None
    if found is not None:
        _touch(path + ".json")
    return found


def _read_entry(path: str, suffix: str) -> tuple[bytes, dict] | None:
    """The entry's checked (data, metadata); None where it is missing or half there (a writer, or an
    eviction, in progress), or written by a jaxstitch whose format differs (it is compiled again)."""
    try:
        with open(path + ".json", "rb") as f:
            raw = f.read()
        with open(path + suffix, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise _Corrupt(f"unreadable: {e}") from None
    try:
        meta = json.loads(raw)
    except ValueError as e:  # (UnicodeDecodeError is one)
        raise _Corrupt(f"{path}.json is not JSON ({e})") from None
    if not isinstance(meta, dict):
        raise _Corrupt(f"{path}.json holds no metadata object")
    if meta.get("format") != FORMAT:
        log.info("kernel cache entry %s.json has another format (%r); compiling it again", path, meta.get("format"))
        return None
    if hashlib.sha256(data).hexdigest() != meta.get("sha256") or len(data) != meta.get("bytes"):
        raise _Corrupt(f"{path}{suffix} does not match the sha256 and size in its .json")
    if suffix == ".cubin":
        if not data.startswith(b"\x7fELF"):
            raise _Corrupt(f"{path}.cubin is not an ELF file")
        try:
            nvrtc.Resources(**meta["resources"])
        except (KeyError, TypeError) as e:
            raise _Corrupt(f"{path}.json lacks the kernel's resources ({e})") from None
    return data, meta


def _discard(path: str, suffix: str, why: str, cache_dir: str | None):
    with _CACHE.lock:
        _CACHE.discarded += 1
        first = path not in _CACHE.warned
        _CACHE.warned.add(path)
    if first:
        log.warning("kernel cache (JAXSTITCH_CACHE_DIR=%s): discarding the corrupt entry %s: %s; "
                    "compiling it again", cache_dir, path + suffix, why)
    for ext in (suffix, ".json"):
        _remove(path + ext)


def _store(path: str, suffix: str, data: bytes, meta: dict, cache_dir: str):
    """Writes the entry (data first, then its .json) and keeps the directory within its bound."""
    meta = {"format": FORMAT, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), **meta}
    raw = json.dumps(meta).encode()
    if _write_atomic(path + suffix, data, cache_dir) and _write_atomic(path + ".json", raw, cache_dir):
        _account(cache_dir, len(data) + len(raw))


def _write_atomic(path: str, data: bytes, cache_dir: str | None = None) -> bool:
    """`data` at `path`, through a temporary file in the same directory renamed over it; False (with
    one warning a directory) where the directory cannot be written: that costs recompiles only."""
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix="." + os.path.basename(path) + ".",
                                   suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return True
    except OSError as e:
        if tmp is not None:
            _remove(tmp)
        where = cache_dir or os.path.dirname(path)
        with _CACHE.lock:
            first = "write:" + where not in _CACHE.warned
            _CACHE.warned.add("write:" + where)
        if first:
            log.warning("could not write the kernel cache at %s: %s", path, e)
        return False


def _touch(path: str):
    try:
        os.utime(path)
    except OSError:
        pass  # (read-only: the entry's age stays its write time)


def _remove(path: str):
    try:
        os.remove(path)
    except OSError:
        pass


def _max_bytes() -> int:
    return config.load().cache_max_bytes


def _account(cache_dir: str, added: int):
    """Counts `added` bytes into the directory's size (counted from disk at this process's first
    write) and evicts where that passes the bound (none when the bound is 0)."""
    bound = _max_bytes()
    if bound <= 0:
        return
    with _DISK_LOCK:
        with _CACHE.lock:
            known = _CACHE.disk_bytes.get(cache_dir)
        total = (_disk_size(cache_dir) if known is None else known + added)
        if total > bound:
            total = _evict(cache_dir, int(bound * EVICT_TO))
        with _CACHE.lock:
            _CACHE.disk_bytes[cache_dir] = total


def _scan(cache_dir: str):
    """(key, file path, size, mtime) of every entry file, and stale temporary files removed."""
    now = time.time()
    try:
        subdirs = [d.path for d in os.scandir(cache_dir) if d.is_dir() and len(d.name) == 2]
    except OSError:
        return
    for sub in subdirs:
        try:
            files = list(os.scandir(sub))
        except OSError:
            continue
        for f in files:
            try:
                st = f.stat()
            except OSError:
                continue  # (removed meanwhile)
            if _ENTRY_FILE.fullmatch(f.name):
                yield f.name.split(".")[0], f.path, st.st_size, st.st_mtime
            elif f.name.endswith(".tmp") and f.name.startswith(".") and now - st.st_mtime > STALE_TEMP_S:
                _remove(f.path)


def _disk_size(cache_dir: str) -> int:
    return sum(size for _, _, size, _ in _scan(cache_dir))


def _evict(cache_dir: str, target: int) -> int:
    """Deletes whole entries, least recently used first, until the directory holds at most `target`
    bytes; returns what it holds then."""
    entries: dict[str, list] = {}  # key -> [bytes, last use, paths]
    for key, path, size, mtime in _scan(cache_dir):
        e = entries.setdefault(key, [0, 0.0, []])
        e[0] += size
        e[1] = max(e[1], mtime)
        e[2].append(path)
    total = sum(e[0] for e in entries.values())
    evicted = 0
    for size, _, paths in sorted(entries.values(), key=lambda e: e[1]):
        if total <= target:
            break
        for p in paths:
            _remove(p)
        total -= size
        evicted += 1
    log.info("kernel cache at %s: evicted %d least recently used entries, %.1f MB left",
             cache_dir, evicted, total / 1e6)
    return total


def stats() -> Stats:
    with _CACHE.lock:
        busy = _CACHE.busy_seconds
        if _CACHE.running:
            busy += time.perf_counter() - _CACHE.busy_since
        return Stats(_CACHE.compiles, _CACHE.memory_hits, _CACHE.disk_hits, _CACHE.nvrtc_seconds, busy,
                     _CACHE.discarded)


def in_flight() -> tuple[int, int]:
    """(lookups asked for and not done, NVRTC compiles running among them): for progress reports."""
    with _CACHE.lock:
        return _CACHE.pending, _CACHE.running


def clear_memory():
    with _CACHE.lock:
        _CACHE.memory.clear()
        _CACHE.ptx.clear()
        _CACHE.timeouts.clear()


def clear(cache_dir: str | None) -> int:
    """Empties the cache in memory and, with a directory, on disk (its entries and temporary files
    only: anything else there stays); returns the files removed."""
    clear_memory()
    if not cache_dir:
        return 0
    removed = 0
    with _DISK_LOCK:
        for _, path, _, _ in _scan(cache_dir):
            _remove(path)
            removed += 1
        try:
            for d in os.scandir(cache_dir):
                if d.is_dir() and len(d.name) == 2:
                    for f in os.scandir(d.path):
                        if f.name.endswith(".tmp") and f.name.startswith("."):
                            _remove(f.path)
                    _rmdir(d.path)
        except OSError:
            pass
        with _CACHE.lock:
            _CACHE.disk_bytes[cache_dir] = 0
    return removed


def _rmdir(path: str):
    try:
        os.rmdir(path)
    except OSError:
        pass  # (not empty: something else lives there)
