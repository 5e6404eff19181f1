"""The kernel cache on disk (checked entries, corrupt ones rebuilt, concurrent writers, the size bound,
jaxstitch.cache.clear), JAXSTITCH_DUMP_DIR's folders, JAXSTITCH_OVERRIDE_DIR's kernels and progress
lines: all on the CPU, with NVRTC."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading

import jax
import jax.numpy as jnp
import pytest

import jaxstitch
from jaxstitch.driver import progress
from jaxstitch.kernels import cache, nvrtc
from jaxstitch.bench.workloads import softmax_fwdbwd

pytestmark = pytest.mark.skipif(not nvrtc.available(), reason="NVRTC is not installed")
S = jax.ShapeDtypeStruct
ARCH = "sm_90"
TINY = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] += %d.0f; }\n'
ROWS = (S((2048, 1024), jnp.float32),)  # (over 4 MB: not launch-bound, planner.LAUNCH_BOUND_BYTES)
PAIR = ROWS * 2


def rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def rms_grad(x):
    return jax.grad(lambda z: jnp.sum(rms(z) ** 2))(x)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private, empty disk cache and an empty memory cache."""
    d = tmp_path / "cache"
    monkeypatch.setenv("JAXSTITCH_CACHE_DIR", str(d))
    cache.clear_memory()
    yield d
    cache.clear_memory()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "jaxstitch" and r.levelno == logging.WARNING]


def _compiled_again(src: str, d) -> bool:
    """Looks `src` up from the disk (memory cleared): whether NVRTC ran."""
    cache.clear_memory()
    before = cache.stats().nvrtc_compiles
    cache.get_cubin(src, ARCH, str(d))
    return cache.stats().nvrtc_compiles > before


def _entry(src: str, d) -> str:
    return cache._entry(str(d), cache.cache_key(src, ARCH))


# ------------------------------------------------------------------------------------------------
# entries are checked; corrupt ones are reported, discarded and rebuilt
# ------------------------------------------------------------------------------------------------

def test_an_entry_carries_its_sha256_and_a_warm_lookup_reads_the_disk(cache_dir):
    src = TINY % 1
    assert _compiled_again(src, cache_dir)
    meta = json.loads(open(_entry(src, cache_dir) + ".json").read())
    cubin = open(_entry(src, cache_dir) + ".cubin", "rb").read()
    assert meta["format"] == cache.FORMAT and meta["bytes"] == len(cubin)
    assert meta["sha256"] == hashlib.sha256(cubin).hexdigest()
    assert not _compiled_again(src, cache_dir)


@pytest.mark.parametrize("damage", ["truncated json", "garbage json", "garbage cubin", "flipped byte",
                                    "garbage cubin with its hash", "json list"])
def test_a_corrupt_entry_is_reported_once_with_its_path_and_rebuilt(cache_dir, caplog, damage):
    src = TINY % 2
    assert _compiled_again(src, cache_dir)
    path = _entry(src, cache_dir)
    meta_text = open(path + ".json").read()
    cubin = open(path + ".cubin", "rb").read()
    if damage == "truncated json":
        open(path + ".json", "w").write(meta_text[:len(meta_text) // 2])
    elif damage == "garbage json":
        open(path + ".json", "wb").write(b"\x00\xff garbage")
    elif damage == "json list":
        open(path + ".json", "w").write("[1, 2]")
    elif damage == "garbage cubin":
        open(path + ".cubin", "wb").write(b"not a cubin")
    elif damage == "flipped byte":
        open(path + ".cubin", "wb").write(cubin[:100] + bytes([cubin[100] ^ 1]) + cubin[101:])
    else:  # a consistent entry whose data is not a cubin
        garbage = b"not a cubin at all"
        meta = dict(json.loads(meta_text), bytes=len(garbage),
                    sha256=hashlib.sha256(garbage).hexdigest())
        open(path + ".cubin", "wb").write(garbage)
        open(path + ".json", "w").write(json.dumps(meta))
    discarded = cache.stats().discarded
    with caplog.at_level(logging.WARNING, logger="jaxstitch"):
        assert _compiled_again(src, cache_dir)
    (said,) = _warnings(caplog)
    assert path in said and "JAXSTITCH_CACHE_DIR" in said and "corrupt" in said, said
    assert cache.stats().discarded == discarded + 1
    # rebuilt: the next process-fresh lookup reads the disk again
    assert not _compiled_again(src, cache_dir)
    assert open(path + ".cubin", "rb").read() == cubin


def test_a_corrupt_json_no_longer_breaks_explain(cache_dir, caplog):
    """It used to raise a bare JSONDecodeError out of jit/explain."""
    first = jaxstitch.explain(softmax_fwdbwd, *PAIR, target="h100")
    assert first.stitched_kernels == 1, first
    jsons = list(cache_dir.rglob("*.json"))
    assert jsons
    for p in jsons:
        p.write_text('{"format": 2, "sha2')
    cache.clear_memory()
    with caplog.at_level(logging.WARNING, logger="jaxstitch"):
        again = jaxstitch.explain(softmax_fwdbwd, *PAIR, target="h100")
    assert again.stitched_kernels == 1 and again.cache.nvrtc_compiles >= 1, again
    said = _warnings(caplog)
    key = again.regions[0].cache_key
    (json_path,) = [p for p in jsons if p.name == key + ".json"]
    assert any(str(json_path) in w and "JAXSTITCH_CACHE_DIR" in w for w in said), said
    assert again.cache.discarded >= 1


def test_an_entry_of_another_format_is_compiled_again_quietly(cache_dir, caplog):
    src = TINY % 3
    assert _compiled_again(src, cache_dir)
    open(_entry(src, cache_dir) + ".json", "w").write(json.dumps({"registers": 8, "spill_bytes": 0,
                                                                  "stack_bytes": 0}))
    with caplog.at_level(logging.WARNING, logger="jaxstitch"):
        assert _compiled_again(src, cache_dir)
    assert not _warnings(caplog)
    assert not _compiled_again(src, cache_dir)


# ------------------------------------------------------------------------------------------------
# writers of the same key at once
# ------------------------------------------------------------------------------------------------

def test_concurrent_writers_of_one_key_leave_a_whole_entry(cache_dir):
    """Writers rename whole files into place: readers meanwhile find the entry missing or whole,
    never torn, and no temporary file stays behind."""
    src = TINY % 4
    cubin, res = nvrtc.compile_cubin(src, ARCH)
    path = _entry(src, cache_dir)
    meta = {"resources": {"registers": res.registers, "spill_bytes": 0, "stack_bytes": 0}}
    errors, stop = [], threading.Event()

    def write():
        for _ in range(40):
            cache._store(path, ".cubin", cubin, meta, str(cache_dir))

    def read():
        while not stop.is_set():
            try:
                found = cache._read_entry(path, ".cubin")
            except cache._Corrupt as e:
                errors.append(str(e))
                return
            if found is not None and found[0] != cubin:
                errors.append("another cubin")

    readers = [threading.Thread(target=read) for _ in range(2)]
    writers = [threading.Thread(target=write) for _ in range(6)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert not errors, errors[:3]
    assert cache._read_entry(path, ".cubin")[0] == cubin
    assert sorted(os.listdir(os.path.dirname(path))) == sorted(os.path.basename(path) + s for s in (".cubin", ".json"))


def test_concurrent_lookups_of_one_new_key_compile_it_once(cache_dir):
    src = TINY % 5
    before = cache.stats().nvrtc_compiles
    got = []
    cache.prefetch(src, ARCH, str(cache_dir))
    threads = [threading.Thread(target=lambda: got.append(cache.get_cubin(src, ARCH, str(cache_dir))[1]))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4 and len(set(got)) == 1
    assert cache.stats().nvrtc_compiles == before + 1


# ------------------------------------------------------------------------------------------------
# the size bound, and clear()
# ------------------------------------------------------------------------------------------------

def _fake_entry(d, i: int, size: int, mtime: float):
    """An entry of `size` bytes of ELF-headed data, last used at `mtime`."""
    key = f"{i:064x}"
    path = cache._entry(str(d), key)
    data = b"\x7fELF" + bytes(size - 4)
    cache._store(path, ".cubin", data, {"resources": {"registers": 8, "spill_bytes": 0, "stack_bytes": 0}},
                 str(d))
    for suffix in (".cubin", ".json"):
        os.utime(path + suffix, (mtime, mtime))
    return path


def _disk_bytes(d) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def test_a_write_past_the_bound_evicts_the_least_recently_used(cache_dir, monkeypatch):
    monkeypatch.setenv("JAXSTITCH_CACHE_MAX_MB", str(100_000 / (1 << 20)))  # 100 kB
    paths = [_fake_entry(cache_dir, i, 20_000, 1_000_000 + i) for i in range(4)]  # 80 kB, oldest first
    assert all(os.path.exists(p + ".cubin") for p in paths)
    assert cache._load(paths[0], ".cubin", str(cache_dir)) is not None  # a hit: now the newest
    newer = [_fake_entry(cache_dir, 10 + i, 20_000, 2_000_000 + i) for i in range(2)]  # past 100 kB
    assert _disk_bytes(cache_dir) <= 100_000 * cache.EVICT_TO
    gone = [p for p in paths + newer if not os.path.exists(p + ".cubin")]
    assert gone == paths[1:3], gone  # the two used least recently; whole entries go
    assert not any(os.path.exists(p + ".json") for p in gone)


def test_no_bound_where_the_bound_is_zero(cache_dir, monkeypatch):
    monkeypatch.setenv("JAXSTITCH_CACHE_MAX_MB", "0")
    paths = [_fake_entry(cache_dir, i, 50_000, 1_000_000 + i) for i in range(4)]
    assert all(os.path.exists(p + ".cubin") for p in paths)


def test_the_bound_reads_its_environment_variable(monkeypatch):
    monkeypatch.delenv("JAXSTITCH_CACHE_MAX_MB", raising=False)
    assert jaxstitch.core.config.load().cache_max_bytes == 1 << 30
    monkeypatch.setenv("JAXSTITCH_CACHE_MAX_MB", "2.5")
    assert jaxstitch.core.config.load().cache_max_bytes == int(2.5 * (1 << 20))
    monkeypatch.setenv("JAXSTITCH_CACHE_MAX_MB", "lots")
    with pytest.raises(ValueError, match="JAXSTITCH_CACHE_MAX_MB"):
        jaxstitch.core.config.load()


def test_cache_clear_empties_memory_and_disk(cache_dir):
    assert jaxstitch.cache.directory() == str(cache_dir)
    assert jaxstitch.explain(softmax_fwdbwd, *PAIR, target="h100").stitched_kernels == 1
    assert list(cache_dir.rglob("*.cubin"))
    (cache_dir / "notes.txt").write_text("not the cache's")
    assert jaxstitch.cache.clear() >= 2
    assert not [p for p in cache_dir.rglob("*") if p.is_file() and p.name != "notes.txt"]
    assert (cache_dir / "notes.txt").exists()
    again = jaxstitch.explain(softmax_fwdbwd, *PAIR, target="h100")
    assert again.cache.nvrtc_compiles >= 1 and again.cache.disk_hits == 0, again
    assert jaxstitch.cache.stats is jaxstitch.cache_stats


# ------------------------------------------------------------------------------------------------
# NVRTC's time limit
# ------------------------------------------------------------------------------------------------

def _flow_callbacks() -> bool:
    return nvrtc.available() and hasattr(nvrtc._nvrtc(), "nvrtcSetFlowCallback")


needs_flow_callbacks = pytest.mark.skipif(not _flow_callbacks(), reason="this NVRTC cannot be cancelled")


@needs_flow_callbacks
def test_a_compile_past_its_time_limit_is_cancelled_and_remembered(cache_dir):
    """NVRTC checks the flow callback between its phases: a limit of a millisecond cancels even a
    tiny kernel. The timeout is remembered on disk: under the same or a smaller limit the key is not
    compiled again, under a larger one or none it is, and its cubin is then read under any limit."""
    src = TINY % 7
    with pytest.raises(nvrtc.CompileTimeout, match="JAXSTITCH_NVRTC_SECONDS"):
        cache.get_cubin(src, ARCH, str(cache_dir), 1e-3)
    assert os.path.exists(_entry(src, cache_dir) + cache.TIMED_OUT + ".json")
    for limit in (1e-3, 1e-4):
        cache.clear_memory()
        before = cache.stats().nvrtc_compiles
        with pytest.raises(nvrtc.CompileTimeout):
            cache.get_cubin(src, ARCH, str(cache_dir), limit)
        assert cache.stats().nvrtc_compiles == before  # (read from the disk: not compiled again)
    assert _compiled_again(src, cache_dir)  # (no limit)
    cache.clear_memory()
    assert cache.get_cubin(src, ARCH, str(cache_dir), 1e-3)[1]  # (compiled since: read, not refused)


@needs_flow_callbacks
def test_a_region_whose_compile_times_out_is_left_to_xla_with_the_reason(cache_dir, monkeypatch, caplog):
    monkeypatch.setenv("JAXSTITCH_NVRTC_SECONDS", "0.001")
    report = jaxstitch.explain(softmax_fwdbwd, *PAIR, target="h100")
    assert report.stitched_kernels == 0
    assert any("JAXSTITCH_NVRTC_SECONDS" in (r.reason or "") for r in report.regions), report
    assert any("JAXSTITCH_NVRTC_SECONDS" in w for w in _warnings(caplog))


def test_a_kernel_longer_than_nvrtc_compiles_quickly_is_not_compiled(cache_dir, monkeypatch):
    from jaxstitch.driver import pipeline

    monkeypatch.setattr(pipeline, "MAX_SOURCE_LINES", 50)
    before = cache.stats().nvrtc_compiles
    report = jaxstitch.explain(softmax_fwdbwd, *PAIR, target="h100")
    assert report.stitched_kernels == 0 and cache.stats().nvrtc_compiles == before
    assert any("lines of CUDA C, more than the 50" in (r.reason or "") for r in report.regions), report


def test_the_time_limit_reads_its_environment_variable(monkeypatch):
    monkeypatch.delenv("JAXSTITCH_NVRTC_SECONDS", raising=False)
    assert jaxstitch.core.config.load().nvrtc_seconds == 30.0
    monkeypatch.setenv("JAXSTITCH_NVRTC_SECONDS", "0")
    assert jaxstitch.core.config.load().nvrtc_seconds == 0.0
    for bad in ("soon", "-1"):
        monkeypatch.setenv("JAXSTITCH_NVRTC_SECONDS", bad)
        with pytest.raises(ValueError, match="JAXSTITCH_NVRTC_SECONDS"):
            jaxstitch.core.config.load()


# ------------------------------------------------------------------------------------------------
# dump folders, kernel overrides
# ------------------------------------------------------------------------------------------------

def test_each_program_dumps_to_a_folder_of_its_own(cache_dir, tmp_path, monkeypatch):
    dump = tmp_path / "dump"
    monkeypatch.setenv("JAXSTITCH_DUMP_DIR", str(dump))
    jaxstitch.explain(softmax_fwdbwd, *PAIR, target="h100")
    jaxstitch.explain(rms_grad, *ROWS, target="h100")
    jaxstitch.explain(softmax_fwdbwd, *[S((512, 1024), jnp.float32)] * 2, target="h100")
    jaxstitch.explain(softmax_fwdbwd, *PAIR, target="h100")  # the same program: the same folder
    folders = sorted(p.name for p in dump.iterdir())
    assert len(folders) == 3, folders
    assert [re.sub(r"-[0-9a-f]{10}$", "", f) for f in folders] == ["rms_grad", "softmax_fwdbwd", "softmax_fwdbwd"], folders
    for f in folders:
        names = {p.name for p in (dump / f).iterdir()}
        assert {"report.txt", "region0.cu", "region0.plan.txt"} <= names, names
        plan = (dump / f / "region0.plan.txt").read_text()
        h = re.search(r"^source ([0-9a-f]{16}) ", plan, re.M).group(1)
        assert h == hashlib.sha256((dump / f / "region0.cu").read_bytes()).hexdigest()[:16]


def test_an_override_is_compiled_in_place_of_the_generated_source(cache_dir, tmp_path, monkeypatch, caplog):
    dump, override = tmp_path / "dump", tmp_path / "override"
    monkeypatch.setenv("JAXSTITCH_DUMP_DIR", str(dump))
    generated = jaxstitch.explain(rms_grad, *ROWS, target="h100").regions[0]
    (folder,) = dump.iterdir()
    h = re.search(r"^source ([0-9a-f]{16}) ", (folder / "region0.plan.txt").read_text(), re.M).group(1)
    override.mkdir()
    edited = (folder / "region0.cu").read_text() + "\n// hand-edited\n"
    (override / f"{h}.cu").write_text(edited)
    monkeypatch.setenv("JAXSTITCH_OVERRIDE_DIR", str(override))
    with caplog.at_level(logging.WARNING, logger="jaxstitch"):
        r = jaxstitch.explain(rms_grad, *ROWS, target="h100").regions[0]
    assert r.stitched and r.cache_key != generated.cache_key
    (said,) = _warnings(caplog)
    assert str(override / f"{h}.cu") in said, said
    # the dump shows what was compiled, under the generated source's hash
    (over,) = [p for p in dump.iterdir() if p != folder]
    compiled = (over / "region0.cu").read_text()
    assert compiled.endswith(edited) and h in compiled.splitlines()[0]
    assert re.search(rf"^source {h} ", (over / "region0.plan.txt").read_text(), re.M)


def test_an_override_nvrtc_rejects_says_where(cache_dir, tmp_path, monkeypatch):
    dump, override = tmp_path / "dump", tmp_path / "override"
    monkeypatch.setenv("JAXSTITCH_DUMP_DIR", str(dump))
    jaxstitch.explain(rms_grad, *ROWS, target="h100")
    (folder,) = dump.iterdir()
    h = re.search(r"^source ([0-9a-f]{16}) ", (folder / "region0.plan.txt").read_text(), re.M).group(1)
    override.mkdir()
    (override / f"{h}.cu").write_text("// line 1\nthis is not CUDA;\n")
    monkeypatch.setenv("JAXSTITCH_OVERRIDE_DIR", str(override))
    monkeypatch.delenv("JAXSTITCH_STRICT", raising=False)
    r = jaxstitch.explain(rms_grad, *ROWS, target="h100").regions[0]
    assert not r.stitched and f"{override / h}.cu(2): error" in r.reason, r.reason


# ------------------------------------------------------------------------------------------------
# progress and the summary line
# ------------------------------------------------------------------------------------------------

def test_a_long_build_shows_progress_and_a_short_one_nothing(cache_dir, monkeypatch, capfd, caplog):
    jaxstitch.explain(softmax_fwdbwd, *PAIR, target="h100")
    assert "jaxstitch: build" not in capfd.readouterr().err  # (well under DELAY_S)
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.05)
    with caplog.at_level(logging.INFO, logger="jaxstitch"):
        jaxstitch.explain(rms_grad, *ROWS, target="h100")
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("jaxstitch: ")]
    assert lines and lines[0].startswith("jaxstitch: building rms_grad: "), lines
    assert lines[-1].startswith("jaxstitch: built rms_grad in "), lines
    assert all(len(ln) <= 100 for ln in lines), lines
    (summary,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("built rms_grad")]
    assert re.search(r"\d+ of \d+ regions? stitched into \d+ kernels?; NVRTC: \d+ compiles?", summary), summary
    monkeypatch.setenv("JAXSTITCH_PROGRESS", "0")
    jaxstitch.explain(rms_grad, *ROWS, target="h100")
    assert "jaxstitch: build" not in capfd.readouterr().err


def test_names_of_functions_as_folder_names():
    import functools

    assert progress.name_of(softmax_fwdbwd) == "softmax_fwdbwd"
    assert progress.name_of(lambda x: x) == "lambda"
    assert progress.name_of(functools.partial(rms)) == "partial_rms"
    assert progress.counted(1, "region") == "1 region" and progress.counted(2, "body", "bodies") == "2 bodies"


# ------------------------------------------------------------------------------------------------
# sources that differ only in their values' names are one kernel, compiled once
# ------------------------------------------------------------------------------------------------

def test_the_canonical_form_renames_value_ids_and_nothing_else():
    a = 'float v12[E]; float a12 = v12[0] + v7[1]; asm("mov.u32 %0, v12;"); // v12\n'
    b = 'float v40[E]; float a40 = v40[0] + v3[1]; asm("mov.u32 %0, v12;"); // v40\n'
    assert cache.canonical(a) == cache.canonical(b)
    assert cache.cache_key(a, ARCH) == cache.cache_key(b, ARCH)
    assert cache.canonical(a).startswith("float v0[E]; float a0 = v0[0] + v1[1];")
    swapped = 'float v12[E]; float a12 = v7[0] + v12[1]; asm("mov.u32 %0, v12;"); // v12\n'
    literal = 'float v12[E]; float a12 = v12[0] + v7[2]; asm("mov.u32 %0, v12;"); // v12\n'
    string = 'float v12[E]; float a12 = v12[0] + v7[1]; asm("mov.u32 %0, v13;"); // v12\n'
    assert len({cache.canonical(s) for s in (a, swapped, literal, string)}) == 4


def two_layers(x, w):
    """Two layer norms of one shape with a matrix product between them: two regions, one kernel
    under two sets of names."""
    def ln(h):
        m = h.mean(-1, keepdims=True)
        return (h - m) * jax.lax.rsqrt(((h - m) ** 2).mean(-1, keepdims=True) + 1e-5)
    return ln(ln(x) @ w)


def test_regions_of_identical_layers_compile_once(cache_dir, tmp_path, monkeypatch):
    """Their two sources, compiled apart, give the same cubin bytes (as the 96 of BERT's train
    step that share 8 canonical forms do)."""
    x, w = jax.ShapeDtypeStruct((4096, 1024), jnp.float32), jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    from strategies import force_stitching

    monkeypatch.setenv("JAXSTITCH_DUMP_DIR", str(tmp_path / "dump"))

    before = cache.stats().nvrtc_compiles
    with force_stitching():  # (a layer norm forward is one XLA kernel: the cost model leaves it)
        report = jaxstitch.explain(two_layers, x, w, target="h200")
    keys = [r.cache_key for r in report.regions if r.stitched]
    assert len(keys) == 2 and len(set(keys)) == 1, str(report)
    assert cache.stats().nvrtc_compiles - before == 1
    sources = sorted({p.read_text() for p in (tmp_path / "dump").rglob("*.cu")})
    assert len(sources) == 2
    assert nvrtc.compile_cubin(sources[0], ARCH)[0] == nvrtc.compile_cubin(sources[1], ARCH)[0]
