"""Shape families on a GPU: one cubin run at many row counts, a program exported with symbolic
dimensions run in a fresh process, and warm starts with JAX's persistent compilation cache. Every
result is compared with jax.jit's, with outputs poisoned (JAXSTITCH_POISON) first."""
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import jaxstitch
from jaxstitch.bench import workloads
from jaxstitch.kernels import cache
from strategies import force_stitching
from test_families import H, NO_CHECK, block, scaled_by_batch, specs, token_stats
from test_gpu_correctness import compare
from test_shifts import token_logprob_one_hot, token_logprob_select

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _norm_bwd_args(rows, seed):
    ks = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(ks[0], (rows, 64)), jax.random.normal(ks[1], (64,)),
            jax.random.normal(ks[2], (64,)), jax.random.normal(ks[3], (rows, 64))]


@pytest.mark.parametrize("name", ["layernorm_fwdbwd_short", "softmax_fwdbwd_short"])
def test_one_cubin_runs_every_row_count(name, monkeypatch):
    """Layer norm fwd+bwd (a grid barrier for dgamma/dbeta) and softmax fwd+bwd, stitched at row counts
    from 2 to 20000: one NVRTC compile, results as jax.jit's. (A single row is planned otherwise: its
    row statistics are scalars.)"""
    monkeypatch.setenv("JAXSTITCH_POISON", "1")
    fn = workloads.WORKLOADS[name].fn

    def check(rows):
        args = _norm_bwd_args(rows, rows)
        if name.startswith("softmax"):
            args = [args[0], args[3]]
        got = jax.block_until_ready(jaxstitch.jit(fn)(*args))
        for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(fn)(*args)))):
            compare(g, w, f"{name} rows={rows} output {i}")
        assert "jaxstitch_launch" in jaxstitch.jit(fn).lower(*args).as_text(), rows

    with force_stitching():
        before = cache.stats()
        for rows in (4096, 2, 7, 333, 20000):
            check(rows)
        assert cache.stats().nvrtc_compiles - before.nvrtc_compiles <= 1  # (0: an earlier test compiled it)
        check(1)


def test_family_kernels_picked_by_row_count(monkeypatch):
    """Per-token statistics over a 262144 vocabulary, exported with symbolic batch and sequence: row
    counts on each side of each bound (XLA's kernels below the first if any, then each split variant
    of the ladder the launcher picks, then the family kernel), each against jax.jit with outputs
    poisoned."""
    pytest.importorskip("flatbuffers")
    monkeypatch.setenv("JAXSTITCH_POISON", "1")
    b, s = jax.export.symbolic_shape("b, s")
    spec = jax.ShapeDtypeStruct((b, s, 262144), jax.numpy.float32)
    (region,) = jaxstitch.explain(token_stats, spec).regions
    bounds = [int(v.split()[1]) for v in region.variants]
    assert region.stitched and bounds, region
    exp = jax.export.export(jaxstitch.jit(token_stats), platforms=["cuda"], disabled_checks=NO_CHECK)(spec)
    call = jax.jit(exp.call)
    for rows in sorted({1, 3, 100} | {r for n in bounds for r in (n - 1, n)}):
        x = jax.random.normal(jax.random.key(rows), (1, rows, 262144)) * 3
        got, want = call(x), jax.jit(token_stats)(x)
        for i, (g, w) in enumerate(zip(got, want)):
            compare(g, w, f"token_stats {rows} rows ({region.variants}) output {i}")


_RUN_EXPORTED = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    import jaxstitch  # registers the custom-call target
    from jaxstitch.kernels import cache
    sys.path.insert(0, sys.argv[3])
    from test_families import arrays, block
    with open(sys.argv[1], "rb") as f:
        exp = jax.export.deserialize(bytearray(f.read()))
    errs = {}
    for batch, seq in json.loads(sys.argv[2]):
        args = arrays(batch, seq, seed=batch * 100 + seq)
        call = jax.jit(exp.call)
        assert "jaxstitch_launch" in call.lower(*args).compile().as_text()
        got, want = call(*args), jax.jit(block)(*args)
        errs[f"{batch}x{seq}"] = [float(np.max(np.abs(np.asarray(g) - np.asarray(w)) / (1 + np.abs(np.asarray(w)))))
                                  for g, w in zip(got, want)]
    print("RESULT", json.dumps({"errors": errs, "nvrtc": cache.stats().nvrtc_compiles}))
""")


def test_exported_symbolic_program_runs_in_a_fresh_process(tmp_path, monkeypatch):
    """jax.export with symbolic batch and sequence; serialized, then run in a new process at shapes
    never planned, against jax.jit there: no NVRTC (the cubins travel in the artifact)."""
    pytest.importorskip("flatbuffers")
    monkeypatch.setenv("JAXSTITCH_POISON", "1")
    b, s = jax.export.symbolic_shape("b, s")
    with force_stitching():
        exp = jax.export.export(jaxstitch.jit(block), platforms=["cuda"], disabled_checks=NO_CHECK)(*specs(b, s))
    assert "jaxstitch_launch" in exp.mlir_module()
    path = tmp_path / "block.jax"
    path.write_bytes(exp.serialize())
    shapes = [[1, 1], [3, 5], [2, 77], [16, 128], [64, 200]]
    run = subprocess.run([sys.executable, "-c", _RUN_EXPORTED, str(path), json.dumps(shapes),
                          os.path.join(ROOT, "tests")], capture_output=True, text=True, timeout=300,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith("JAXSTITCH_")},
                              "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.split("RESULT", 1)[1])
    assert result["nvrtc"] == 0
    for shape, errs in result["errors"].items():
        assert max(errs) < 1e-5, (shape, errs)


def test_a_size_read_as_a_value_runs_at_every_size(monkeypatch):
    """`gelu(x * g) / x.shape[0]` exported with a symbolic batch: the kernel reads the batch from the
    scalar XLA makes of it, so every batch divides by its own size (outputs poisoned)."""
    monkeypatch.setenv("JAXSTITCH_POISON", "1")
    b, = jax.export.symbolic_shape("b")
    args = [jax.ShapeDtypeStruct((b, H), np.float32), jax.ShapeDtypeStruct((H,), np.float32)]
    with force_stitching():
        exp = jax.export.export(jaxstitch.jit(scaled_by_batch), platforms=["cuda"], disabled_checks=NO_CHECK)(*args)
    assert "jaxstitch_launch" in exp.mlir_module()
    for batch in (1, 7, 64, 1000):
        x = jax.random.normal(jax.random.key(batch), (batch, H))
        g = jax.random.uniform(jax.random.key(batch + 1), (H,), minval=0.5, maxval=1.5)
        compare(exp.call(x, g), jax.jit(scaled_by_batch)(x, g), f"batch={batch}")


_WARM = textwrap.dedent("""
    import jax, numpy as np
    jax.config.update("jax_compilation_cache_dir", __import__("sys").argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import jaxstitch
    from jaxstitch.bench import workloads
    w = workloads.WORKLOADS["layernorm_fwdbwd_short"]
    args = w.make_inputs(jax.random.key(3), jax.numpy.float32, True)
    got, want = jaxstitch.jit(w.fn)(*args), jax.jit(w.fn)(*args)
    err = max(float(np.max(np.abs(np.asarray(g) - np.asarray(v)))) for g, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    rep = jaxstitch.explain(w.fn, *args)
    print("RESULT", err, sum(r.stitched for r in rep.regions), jaxstitch.cache_stats().nvrtc_compiles)
""")


def test_warm_start_with_jax_persistent_cache(tmp_path):
    """Two fresh processes with JAX's persistent compilation cache and our disk cache: the second runs
    NVRTC zero times and gives the same results as jax.jit."""
    # (the children allocate GPU memory as they need it: this process's pool holds most of an H100's)
    env = dict(os.environ, JAXSTITCH_CACHE_DIR=str(tmp_path / "kernels"), JAXSTITCH_TUNE="min_gain_pct=1",
               XLA_PYTHON_CLIENT_PREALLOCATE="false")
    outs = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", _WARM, str(tmp_path / "xla")], env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        err, stitched, nvrtc = run.stdout.split("RESULT", 1)[1].split()
        outs.append((float(err), int(stitched), int(nvrtc)))
    assert outs[0][1] >= 1 and outs[0][2] >= 1
    assert outs[1][2] == 0
    for err, _, _ in outs:
        assert err < 1e-4
    assert os.listdir(tmp_path / "xla")  # JAX's cache was written (and read by the second process)


@pytest.mark.parametrize("rows", [5, 40, 200])
@pytest.mark.parametrize("offset", [0.0, 100.0])
def test_one_pass_statistics_match_with_offsets_and_special_values(rows, offset, monkeypatch):
    """Log-softmax statistics read in one pass (plan/shifts.py: the mean's shifts taken out, its
    sum over x minus the row's first element): logits with a large common offset, and rows holding
    -inf beside finite values, only -inf, an +inf, a NaN, a -inf first element, against jax.jit
    with outputs poisoned, special values where jax.jit has them. (The max is max(x) - max(x) - log
    s bit for bit as written, but s, the sum of exponentials, is rounded otherwise than XLA's.)"""
    monkeypatch.setenv("JAXSTITCH_POISON", "1")
    x = jax.random.normal(jax.random.key(rows), (rows, 262144)) * 3 + offset
    x = x.at[0, ::7].set(-jax.numpy.inf).at[1, :].set(-jax.numpy.inf).at[2, 5].set(jax.numpy.inf)
    x = x.at[3, 9].set(jax.numpy.nan).at[4, 0].set(-jax.numpy.inf)
    fn = jaxstitch.jit(token_stats)
    assert "shifts out of 2" in jaxstitch.explain(token_stats, x).regions[0].mapping
    (mean, mx), (want_mean, want_max) = fn(x), jax.jit(token_stats)(x)
    for got, want, what in ((mean, want_mean, "mean"), (mx, want_max, "max")):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
        compare(got, want, f"token_stats {what}, {rows} rows, offset {offset}")


@pytest.mark.parametrize("fun", [token_logprob_select, token_logprob_one_hot])
@pytest.mark.parametrize("rows,cols", [(5, 262144), (200, 262144), (1007, 32000)])
@pytest.mark.parametrize("offset", [0.0, 100.0])
def test_one_pass_picks_match_with_offsets_and_special_values(fun, rows, cols, offset, monkeypatch):
    """A picked log-probability read in one pass (plan/shifts.py: the masked sum's shifts taken out,
    k (C - p) subtracted): picks of -inf, +inf and NaN entries, a row of -inf, a label matching no
    column (0), logits with a large common offset; against jax.jit with outputs poisoned."""
    monkeypatch.setenv("JAXSTITCH_POISON", "1")
    kx, kl = jax.random.split(jax.random.key(rows + cols))
    x = jax.random.normal(kx, (rows, cols)) * 3 + offset
    x = x.at[0, ::7].set(-jax.numpy.inf).at[1, :].set(-jax.numpy.inf).at[2, 5].set(jax.numpy.inf)
    x = x.at[3, 9].set(jax.numpy.nan)
    labels = jax.random.randint(kl, (rows,), 0, cols).at[:5].set(jax.numpy.array([0, 3, 5, 9, -1]))
    (r,) = jaxstitch.explain(fun, x, labels).regions
    assert r.stitched and "shifts out of 1" in r.mapping and "one pass" in r.mapping, r.mapping
    got, want = jaxstitch.jit(fun)(x, labels), jax.jit(fun)(x, labels)
    for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_array_equal(np.isinf(g), np.isinf(w))
        compare(g, w, f"{fun.__name__} output {i}, {rows}x{cols}, offset {offset}")


def softmax_bwd_in_dtype(x, dy):
    """jax.nn.softmax's backward in the inputs' own dtype (bfloat16 sums for bfloat16 rows)."""
    y, vjp = jax.vjp(lambda x: jax.nn.softmax(x, axis=-1), x)
    return y, vjp(dy)[0]


@pytest.mark.parametrize("fun", [workloads.softmax_fwdbwd, softmax_bwd_in_dtype])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows,cols", [(32, 262144), (5, 262144), (200, 32000), (1000, 1000), (4096, 16)])
def test_softmax_backward_sums_in_the_max_pass_match(fun, dtype, rows, cols, monkeypatch):
    """The backward's sum(dy * y) as a weighted online sum (plan/shifts.py takes the 1 / s^2 factor
    out, plan/online.py folds sum(dy * exp(x - max)) into the max's pass) where rows are split over
    blocks or walked in chunks; as before where a row is held in registers (1000 and 16 columns) or
    the sums are bfloat16 (jax.nn.softmax's backward in bfloat16). Logits with a large offset and
    rows holding -inf beside finite values, only -inf, an +inf and a NaN; against jax.jit, outputs
    poisoned."""
    monkeypatch.setenv("JAXSTITCH_POISON", "1")
    kx, kd = jax.random.split(jax.random.key(rows * cols))
    x = jax.random.normal(kx, (rows, cols)) * 3 + 40.0
    x = x.at[0, ::7].set(-jax.numpy.inf).at[1, :].set(-jax.numpy.inf).at[2, 5].set(jax.numpy.inf)
    x = x.at[3, 9].set(jax.numpy.nan).astype(dtype)
    dy = jax.random.normal(kd, (rows, cols), dtype)
    weighted = cols >= 32000 and (fun is workloads.softmax_fwdbwd or dtype == "float32")
    with force_stitching():
        (r,) = jaxstitch.explain(fun, x, dy).regions
        assert r.stitched and ("with 1 weighted sum" in r.mapping) == weighted, r.mapping
        got = jaxstitch.jit(fun)(x, dy)
    # jax.nn.softmax's backward in bfloat16 rounds every op to bfloat16 under jax.jit, and its
    # dy - sum(dy * y) cancels: 6% off at 16 columns (row 194: -0.4531 where the exact value is
    # -0.4260 and ours -0.4258). There both are held to the float32 result of the same inputs, ours
    # no further from it than jax.jit's.
    exact = jax.jit(fun)(x.astype("float32"), dy.astype("float32")) if fun is softmax_bwd_in_dtype \
        and dtype == "bfloat16" else None
    for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(fun)(x, dy)))):
        g32, w32 = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_array_equal(np.isnan(g32), np.isnan(w32))
        if exact is None:
            compare(g, w, f"{fun.__name__} output {i}, {rows}x{cols} {dtype}")
            continue
        e32 = np.asarray(jax.tree.leaves(exact)[i])
        ok = np.isfinite(e32) & np.isfinite(w32)
        ours, theirs = (float(np.max(np.abs(a[ok] - e32[ok]), initial=0.0)) for a in (g32, w32))
        assert ours <= theirs + 2 ** -8 * float(np.max(np.abs(e32[ok]), initial=0.0)), (i, ours, theirs)
