"""Shape families (families.py) and warm starts, on CPU: one cubin for every row count, jax.export
with symbolic dimensions, the report's NVRTC counter across processes."""
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstitch
from jaxstitch.bench import workloads
from jaxstitch.kernels import cache
from strategies import force_stitching

H = 256
NO_CHECK = jaxstitch.disabled_checks()


def block(x, g, b, att):
    """A transformer block's memory-bound pieces: layer norm + GELU over rows of H (a family for any
    batch and sequence length), and a softmax over rows as long as the sequence (not one)."""
    y = workloads.layernorm(x, g, b)
    return jax.nn.gelu(y) * 2.0, jax.nn.softmax(att * 0.125, axis=-1)


def specs(batch, seq):
    f32 = jnp.float32
    return [jax.ShapeDtypeStruct((batch, seq, H), f32), jax.ShapeDtypeStruct((H,), f32),
            jax.ShapeDtypeStruct((H,), f32), jax.ShapeDtypeStruct((batch, 4, seq, seq), f32)]


def arrays(batch, seq, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(k, s.shape, s.dtype) for k, s in zip(keys, specs(batch, seq))]


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSTITCH_CACHE_DIR", str(tmp_path))
    cache.clear_memory()
    yield tmp_path
    cache.clear_memory()


def test_one_cubin_serves_every_row_count(fresh_cache):
    fn = workloads.WORKLOADS["layernorm_fwdbwd_short"].fn  # row and column reductions, grid barrier
    keys = set()
    with force_stitching():
        for rows in (4096, 5000, 333, 65536):
            args = [jax.ShapeDtypeStruct((rows, 64), jnp.float32), jax.ShapeDtypeStruct((64,), jnp.float32),
                    jax.ShapeDtypeStruct((64,), jnp.float32), jax.ShapeDtypeStruct((rows, 64), jnp.float32)]
            rep = jaxstitch.explain(fn, *args, target="h100")
            assert [r.stitched for r in rep.regions] == [True]
            assert rep.regions[0].rows == rows
            keys.add(rep.regions[0].cache_key)
            assert rep.cache.nvrtc_compiles == (1 if rows == 4096 else 0), rep
    assert len(keys) == 1


def test_symbolic_dimensions_stitch_the_families_and_say_why_not(fresh_cache):
    b, s = jax.export.symbolic_shape("b, s")
    with force_stitching():
        rep = jaxstitch.explain(block, *specs(b, s), target="h100")
    assert rep.symbolic and "symbolic dimensions" in str(rep)
    norm, softmax = sorted(rep.regions, key=lambda r: "exp" in r.ops)
    assert norm.stitched and norm.reason is None
    assert not softmax.stitched and "not one kernel for every size" in softmax.reason
    assert "source changes with the sizes" in softmax.reason


VOCAB = 131072  # (a long vocabulary: 30522 gets no split variant, the cost model expects no gain)


def token_stats(x):
    """Per-token log-softmax statistics over a vocabulary: long rows, as many as batch x sequence."""
    lp = jax.nn.log_softmax(x, axis=-1)
    return lp.mean(-1), jnp.max(lp, -1)


def _dense_i64(text: str) -> list[int]:
    """An MLIR dense<...> of int64: a list, or (over 100 elements) hex of little-endian bytes."""
    if text.startswith('"0x'):
        return np.frombuffer(bytes.fromhex(text[3:-1]), "<i8").tolist()
    return [int(n) for n in text.strip("[]").split(",")]


def test_long_rows_get_a_ladder_of_split_row_variants_for_few_rows(fresh_cache, monkeypatch):
    """A family of long rows runs a block per row; for fewer rows than SMs, a ladder of variants
    splits each row over several blocks (at most one (row, slice) task per SM, two where they stash
    whole or where one leaves over a fifth of the SMs idle, four for 16 KB slices), the launcher
    picking the first whose bound exceeds the rows. Each variant's source is the same at both
    samples (its workspace does not grow with the rows), and its stash is sized for the rows it
    runs at, not the samples'. (The statistics read in two passes, as written: JAXSTITCH_TUNE
    shifts=0; one pass keeps no stash, test_one_pass_family_ladder.)"""
    monkeypatch.setenv("JAXSTITCH_TUNE", "shifts=0")
    b, s = jax.export.symbolic_shape("b, s")
    spec = jax.ShapeDtypeStruct((b, s, VOCAB), jnp.float32)
    rep = jaxstitch.explain(token_stats, spec, target="h100")  # (the target _export plans for)
    (region,) = rep.regions
    assert region.stitched and "rows split" not in region.mapping
    ladder = [re.match(r"below (\d+) rows: .*rows split over (\d+) blocks(.*)", v).groups()
              for v in region.variants if "XLA" not in v]
    bounds, splits = [int(b) for b, _, _ in ladder], [int(k) for _, k, _ in ladder]
    assert bounds == sorted(bounds) and len(ladder) >= 3
    assert bounds[0] <= 132 * 4 // splits[0] + 1  # small slices first: up to four tasks per SM
    per_sm = [-(-(b - 1) * k // 132) for b, k in zip(bounds, splits)]  # at each range's top
    assert 2 in per_sm and all(p <= 2 or k == splits[0] for p, k in zip(per_sm, splits)), ladder
    for lo, hi, (_, k, rest), p in zip([1] + bounds, bounds, ladder, per_sm):
        if p == 2 and int(k) != splits[0]:  # two to an SM only where their stash holds them whole,
            # or where one to an SM leaves over a fifth of the SMs idle
            assert "stash of" not in rest or all(n * (132 // n) < 0.8 * 132 for n in range(lo, hi)), (lo, hi, k)

    def rung(rows):
        return next(k for b, k in zip(bounds, splits) if rows < b)
    assert rung(34) == rung(35) == 7 and rung(47) == 5  # two to an SM, not 3 and 2
    assert "shared stash of 1," not in " ".join(v for *_, v in ladder)  # (sized for the samples' rows)
    assert "below" in str(rep)
    short = jax.ShapeDtypeStruct((b, s, 30522), jnp.float32)
    assert jaxstitch.explain(token_stats, short, target="h200").regions[0].variants == ()
    exp = _export(token_stats, [spec], ["cuda"])
    call = re.search(r"custom_call @jaxstitch_launch\(.*", exp.mlir_module()).group(0)
    alt = _dense_i64(re.search(r"alt_launch = dense<([^>]*)>", call).group(1))
    assert len(alt) == 9 * len(ladder)  # below_rows ... splits ... bytes, for each variant
    assert alt[0::9] == bounds and alt[6::9] == splits
    # JAXSTITCH_TUNE=variants=0: the member alone
    monkeypatch.setenv("JAXSTITCH_TUNE", "shifts=0,variants=0")
    (plain,) = jaxstitch.explain(token_stats, spec, target="h200").regions
    assert plain.stitched and plain.cache_key == region.cache_key
    assert all("XLA" in v for v in plain.variants)


def test_one_pass_family_ladder(fresh_cache):
    """The statistics with their shifts taken out (plan/shifts.py) read each row once: the member
    and every rung of its ladder keep nothing in a stash; small slices first, up to four to an SM."""
    b, s = jax.export.symbolic_shape("b, s")
    spec = jax.ShapeDtypeStruct((b, s, VOCAB), jnp.float32)
    (region,) = jaxstitch.explain(token_stats, spec, target="h100").regions
    assert region.stitched and "one pass" in region.mapping and "shifts out of 2" in region.mapping
    ladder = [re.match(r"below (\d+) rows: .*rows split over (\d+) blocks(.*)", v).groups() for v in region.variants]
    bounds, splits = [int(b) for b, _, _ in ladder], [int(k) for _, k, _ in ladder]
    assert len(ladder) >= 3 and bounds == sorted(bounds)
    assert all("one pass" in rest and "stash" not in rest for *_, rest in ladder)
    assert bounds[0] <= 132 * 4 // splits[0] + 1
    assert all(-(-(b - 1) * k // 132) <= 2 or k == splits[0] for b, k in zip(bounds, splits))


def test_xla_runs_a_long_row_family_below_its_row_bound(fresh_cache, monkeypatch):
    """One row of a 262144 vocabulary: XLA spreads it over the GPU, our family kernel without its
    split variants gives it one block (9 vs 32 us, H200). The exported program then holds a
    conditional on the row count: XLA's kernels below the bound the cost model sets, ours above;
    with the ladder of split variants (the default), or for a 30522 vocabulary, none."""
    b, s = jax.export.symbolic_shape("b, s")
    spec = jax.ShapeDtypeStruct((b, s, 262144), jnp.float32)
    assert "stablehlo.case" not in _export(token_stats, [spec], ["cuda"]).mlir_module()
    monkeypatch.setenv("JAXSTITCH_TUNE", "variants=0")
    assert "stablehlo.case" in _export(token_stats, [spec], ["cuda"]).mlir_module()
    exp = _export(token_stats, [spec], ["cpu", "cuda"])
    text = exp.mlir_module()
    assert "jaxstitch_launch(" in text
    short = _export(token_stats, [jax.ShapeDtypeStruct((b, s, 30522), jnp.float32)], ["cuda"])
    assert "stablehlo.case" not in short.mlir_module()
    for batch, seq in ((1, 1), (2, 40)):  # (on CPU both branches are XLA's: the results hold)
        x = jax.random.normal(jax.random.key(seq), (batch, seq, 262144))
        for got, want in zip(exp.call(x), jax.jit(token_stats)(x)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_symbolic_trace_at_a_size_is_that_sizes_trace():
    """trace.at_sizes: the program traced with symbolic dimensions, evaluated at a size, has the ops,
    shapes and params of the program traced at that size (families.py plans it instead of tracing
    the function again)."""
    import functools
    from jaxstitch.frontend import trace
    from jaxstitch.integration.families import _size
    b, s = jax.export.symbolic_shape("b, s")

    def signature(traced):
        return [(op.prim, [getattr(a, "shape", a) for a in op.inputs], [v.shape for v in op.outputs], op.params)
                for op in traced.graph.ops]
    symbolic = trace.trace(block, specs(b, s), trace.positional_tree(specs(b, s)))
    for size in (1, 64, 96):
        concrete = trace.trace(block, specs(size, size), trace.positional_tree(specs(size, size)))
        at = trace.at_sizes(symbolic, functools.partial(_size, value=size))
        assert signature(at) == signature(concrete)
        assert [v.shape for v in at.graph.inputs] == [tuple(a.shape) for a in specs(size, size)]


def scaled_by_batch(x, g):
    """A size read as a value: the batch divides every element (a mean's 1/n)."""
    return jax.nn.gelu(x * g) / x.shape[0]


def test_a_size_read_as_a_value_is_read_at_run_time(fresh_cache):
    """`x / x.shape[0]` with a symbolic batch: the region reads the batch as a scalar input made by
    `dim_as_value`, so its kernel is the same at every size and serves the family (traced at the
    sample sizes it held 1/64 and 1/96 as literals, two different kernels)."""
    b, = jax.export.symbolic_shape("b")
    args = [jax.ShapeDtypeStruct((b, H), jnp.float32), jax.ShapeDtypeStruct((H,), jnp.float32)]
    with force_stitching():
        rep = jaxstitch.explain(scaled_by_batch, *args, target="h100")
        exp = _export(scaled_by_batch, args, ["cpu", "cuda"])
    gelu = next(r for r in rep.regions if "tanh" in r.ops or "erf" in r.ops)
    assert gelu.stitched and gelu.reason is None, rep
    assert "dim_as_value" in [name for name, _ in rep.xla_ops], rep
    for batch in (1, 3, 40):  # (on CPU the region runs as its jaxpr, through XLA)
        x, g = jax.random.normal(jax.random.key(batch), (batch, H)), jnp.linspace(0.5, 1.5, H)
        np.testing.assert_allclose(exp.call(x, g), jax.jit(scaled_by_batch)(x, g), rtol=1e-6, atol=1e-7)


def test_symbolic_sizes_evaluate_like_jax():
    from jaxstitch.integration.families import _size
    b, s = jax.export.symbolic_shape("b, s")
    for d, want in ((b, 7), (2 * b + 1, 15), (b * s, 49), (b // 2, 3), (b % 3, 1), (7, 7)):
        assert _size(d, 7) == want, d


def _export(fn, args, platforms):
    return jax.export.export(jaxstitch.jit(fn, target="h100"), platforms=platforms,
                             disabled_checks=NO_CHECK)(*args)


def test_export_with_symbolic_batch_and_sequence_round_trips(fresh_cache):
    pytest.importorskip("flatbuffers")
    b, s = jax.export.symbolic_shape("b, s")
    with force_stitching():
        exp = _export(block, specs(b, s), ["cpu", "cuda"])
    text = exp.mlir_module()
    calls = re.findall(r"custom_call @jaxstitch_launch\(.*", text)
    assert len(calls) == 1  # the layer norm's family; the softmax stays with XLA
    assert "rows_buffer = 0" in calls[0] and "rows_per_block" in calls[0]
    attrs = re.sub(r"cubin = dense<[^>]*>", "", calls[0])  # (the cubin: an ELF file, 0x7F454C46...)
    assert not re.search(r"0x[0-9a-fA-F]{8,}", attrs)  # data only, no process-local pointers
    again = jax.export.deserialize(exp.serialize())
    for batch, seq in ((3, 5), (1, 1), (2, 33)):  # on CPU the region runs as its jaxpr, through XLA
        args = arrays(batch, seq, seed=batch)
        for got, want in zip(again.call(*args), jax.jit(block)(*args)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_export_from_cpu_for_cuda_carries_the_cubin(fresh_cache):
    b, = jax.export.symbolic_shape("b")
    args = [jax.ShapeDtypeStruct((b, 128, 768), jnp.float32), jax.ShapeDtypeStruct((768,), jnp.float32),
            jax.ShapeDtypeStruct((768,), jnp.float32)]
    with force_stitching():
        exp = _export(lambda x, g, b: jax.nn.gelu(workloads.layernorm(x, g, b)), args, ["cuda"])
    call = re.search(r"custom_call @jaxstitch_launch\(.*", exp.mlir_module()).group(0)
    assert re.search(r"cubin = dense<.*> : tensor<\d+xui8>", call)
    assert "row_elems = 768" in call
    assert exp.platforms == ("cuda",)


def test_warm_start_runs_nvrtc_zero_times(tmp_path):
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, jaxstitch
        from jaxstitch.bench import workloads
        w = workloads.WORKLOADS["softmax_fwdbwd_short"]
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in w.make_inputs(jax.random.key(0), jnp.float32, True)]
        rep = jaxstitch.explain(w.fn, *args, target="h100")
        print("STITCHED", sum(r.stitched for r in rep.regions), "NVRTC", rep.cache.nvrtc_compiles,
              "DISK", rep.cache.disk_hits)
    """)
    env = dict(os.environ, JAXSTITCH_CACHE_DIR=str(tmp_path), JAXSTITCH_TUNE="min_gain_pct=1")
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    counts = []
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
        stitched, nvrtc, disk = map(int, re.search(r"STITCHED (\d+) NVRTC (\d+) DISK (\d+)", run.stdout).groups())
        counts.append((stitched, nvrtc, disk))
    (s1, n1, d1), (s2, n2, d2) = counts
    assert s1 == s2 >= 1
    assert n1 >= s1 and d1 == 0      # cold: every kernel compiled
    assert n2 == 0 and d2 >= s2      # warm: none


def test_export_of_transformed_stitched_functions_with_symbolic_batch(fresh_cache):
    """jax.grad of a stitched function (its regions planned again by the transformation rules) and a
    stitched jax.grad, exported with a symbolic batch, give jax.grad's results on CPU."""
    def loss(x, g, b):
        return jnp.sum(jax.nn.gelu(workloads.layernorm(x, g, b)) ** 2)

    b, = jax.export.symbolic_shape("b")
    args_spec = [jax.ShapeDtypeStruct((b, H), jnp.float32), jax.ShapeDtypeStruct((H,), jnp.float32),
                 jax.ShapeDtypeStruct((H,), jnp.float32)]
    x, g, beta = arrays(37, 1)[0].reshape(37, H), jnp.linspace(0.5, 1.5, H), jnp.linspace(-1, 1, H)
    want = jax.grad(loss, argnums=(0, 1))(x, g, beta)
    with force_stitching():
        for fn in (jax.grad(jaxstitch.jit(loss, target="h100"), argnums=(0, 1)),
                   jaxstitch.jit(jax.grad(loss, argnums=(0, 1)), target="h100")):
            exp = jax.export.export(jax.jit(fn), platforms=["cpu", "cuda"], disabled_checks=NO_CHECK)(*args_spec)
            for got, w in zip(exp.call(x, g, beta), want):
                np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-4)
    assert "jaxstitch_launch" in exp.mlir_module()  # (the stitched jax.grad: one family kernel)


def test_rows_go_to_the_rung_whose_busiest_sm_reads_least():
    """`ladder.rows_to_rungs` on an H100's 132 SMs and rows of 262144 float32: each row count to the rung
    that holds it in one round and whose busiest SM reads least; a rung of two tasks to an SM that
    does not stash whole only where split_count splits so (34-35 rows), and the ladder ends at the
    first row count no rung takes."""
    from types import SimpleNamespace

    from jaxstitch.plan.ladder import Rung
    from jaxstitch.plan.ladder import rows_to_rungs as _rows_to_rungs
    from jaxstitch.targets import get_target
    h100, m = get_target("h100"), SimpleNamespace(n_cols=262144, vec=4)
    four, three, seven, seven_whole = (Rung(4, 1, 33, "4"), Rung(3, 1, 44, "3"), Rung(7, 2, 37, "7x2"),
                                       Rung(7, 2, 37, "7x2 whole", whole=True))
    assert _rows_to_rungs((four, three, seven), m, h100) == ((19, "7x2"), (34, "4"), (36, "7x2"), (45, "3"))
    # stashed whole: two to an SM wherever the busiest SM reads less (not 19-33 rows: 2/7 of a row
    # against 1/4), and a rung winning two ranges appears twice
    assert _rows_to_rungs((four, seven_whole), m, h100) == ((19, "7x2 whole"), (34, "4"), (38, "7x2 whole"))
    assert _rows_to_rungs((seven,), m, h100) == ((19, "7x2"),)  # 19 rows: not taken, the member's
