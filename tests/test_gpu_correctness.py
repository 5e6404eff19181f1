"""Stitched kernels against XLA on a real GPU: every workload, random region graphs, run-to-run bits.

All tests here are `gpu` tests (skipped without an NVIDIA GPU). They compare `jaxstitch.jit(fn)` (which
detects the GPU, plans, compiles and launches our kernels) with `jax.jit(fn)` on fresh random inputs:
the seed changes every run (set JAXSTITCH_TEST_SEED to replay one; failures print it). Errors are
measured relative to the largest magnitude of the reference output:
float32 <= 2e-5, bfloat16 <= 2e-2, float16 <= 5e-3, integers and bools exact, and no NaN where the
reference has none. Each jaxstitch function runs three times on the same inputs and must give the same
bits every time (a moving result is a race). JAXSTITCH_GPU_EXAMPLES sets the number of random graphs
(default 40) for a deeper run.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import jaxstitch
from jaxstitch.integration import ffi
from jaxstitch.kernels import xla_kernel
from jaxstitch.core.ops import ELEMENTWISE, VIEWS
from jaxstitch.bench.workloads import WORKLOADS, causal_softmax_bwd
from hypothesis import event

from strategies import coarser, force_stitching, random_inputs, region_graphs
from test_views import CASES as VIEW_CASES, POSITIONAL_CASES, SPREAD_CASES, _random as view_inputs, causal_attention_grad
from test_pairs import PAIR_CASES
from test_scans import CASES as SCAN_CASES
from test_variadic import CASES as VARIADIC_CASES
from test_tile_one_warp import stats_read_later
from test_tile_transpose import CASES as TRANSPOSE_CASES
from test_prng import CASES as PRNG_CASES, case_inputs as prng_inputs
from test_pipeline_cpu import bias_grads_then_adam
from test_transforms import COMPOSITIONS, CONTROL_FLOW, FUNS, MIN_KERNELS, stitched_kernels
from test_wide_scatter import embedding_grad, widened
from test_merged_products import swiglu_grads
from test_roundings import momentum_specs, momentum_steps
from test_recompute import ATTENTION_SPECS, gpt_attention_grads
from test_prefixes import masked_softmax
from test_batched_products import bias_attention_grads, bias_specs, rotary_attention_grads, rotary_specs
from test_recompute import (RESIDUAL_SPECS, SHARED_SPECS, SLICED_SPECS, SPECS as RECOMPUTE_SPECS,
                            halves_across_a_dot, norm_across_a_dot, readers_left_to_xla,
                            residual_norm_across_a_dot, shared_leaf_across_a_dot)
from jaxstitch.core.ops import VARIADIC
from jaxstitch.core.ops import SCANS
from jaxstitch.bench.workloads import TOP_P

pytestmark = pytest.mark.gpu
# Kernel outputs are filled with NaN bytes before every launch, so an element a kernel never writes
# shows as a NaN where the reference has none (read when the stitched function is built).
os.environ.setdefault("JAXSTITCH_POISON", "1")

RUN_SEED = int(os.environ.get("JAXSTITCH_TEST_SEED") or np.random.SeedSequence().entropy % (1 << 63))
TOL = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 5e-3}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
RUNS = 3

# One odd shape per workload: N = 1000 + 7 rows; C odd where the workload allows (xent keeps its vocab).
ODD_SHAPES = {
    "layernorm_fwd": (1007, 771),
    "layernorm_fwdbwd": (1007, 1022),
    "rmsnorm_residual_fwdbwd": (1007, 769),
    "softmax_fwd": (1007, 1001),
    "softmax_fwdbwd": (1007, 999),
    "xent_fwdbwd": (1007, 32000),
    "xent_labels_fwdbwd": (1007, 32000),
    "token_logprob": (1007, 32000),
    "bias_gelu_dropout": (1007, 1023),
    "fig7_chain": (1007, 2047),
    "gelu_layernorm": (1007, 1023),
    "softmax_fwdbwd_long": (3, 20001),
    "softmax_fwdbwd_short": (4099, 63),
    "layernorm_fwdbwd_short": (4099, 61),
    "bias_gelu_bwd": (1007, 1021),
    "bias_gelu_bwd_narrow": (16411, 15),
    "dien_attention_fwdbwd": (517, 50, 36),
    "adamw_bert": (1, 40, 101),
    "rmsnorm_rope_fwd": (1007, 512),
    "rmsnorm_rope_fwdbwd": (1007, 512),
    "top_p_filter": (1007, 3001),
    "survival_fwdbwd": (1007, 509),
    "moe_router": (4099, 61),
    "attention_softmax_bwd": (7, 127, 127),
    "dien_gru_fwdbwd": (301, 13, 20),
}
# Workloads with matrix products inside stitched kernels (a persistent scan's recurrent product):
# compared with float32 products on both sides, as XLA's default on this GPU may be TF32.
FULL_PRECISION = ("dien_gru_fwdbwd",)
# Recurrences in half precision: both sides round the carry at every step, in different places, and
# the differences grow with the steps (the GRU's bfloat16 gradient, one seed in a few hundred: 2.7%
# of its largest value apart, the same with the in-place sums off). Each output is compared with
# the function run in float32 on the same inputs instead, within the tolerance plus twice XLA's
# own distance from it.
RECURRENT = ("dien_gru_fwdbwd",)

# Expected stitched kernels at the quick shapes (as in test_pipeline_cpu.py), with the known bugs that
# still keep some from it (strict xfails: they fail loudly once fixed, then drop the entry).
# fig7_chain is absent on purpose: XLA runs it as one kernel, so the planner leaves it to XLA;
# rmsnorm_residual_fwdbwd is stitched at full size only: at the quick shape the estimated gain is below
# cost.MIN_GAIN (XLA reaches ~65-70% of HBM on it).
ONE_KERNEL = ("layernorm_fwdbwd", "softmax_fwdbwd", "xent_fwdbwd", "token_logprob", "gelu_layernorm")
KNOWN_PLAN_BUGS: dict[str, str] = {}


# Random-graph features that hit known wrong-result bugs (none today; outputs that are reductions over
# size-1 axes were once never stored: test_size1_reduction_output_is_written).
KNOWN_WRONG_RESULT_FEATURES = ()


def _msg(what, seed):
    return f"{what} (JAXSTITCH_TEST_SEED={RUN_SEED}, input seed {seed})"


@pytest.fixture(scope="module", autouse=True)
def launcher_ready():
    """On a GPU machine the launcher must load: otherwise jaxstitch.jit is plain jax.jit and every
    comparison here would pass without testing anything."""
    ok, why = ffi.register()
    assert ok, f"the jaxstitch launcher is unavailable on this GPU machine: {why}"
    print(f"\njaxstitch GPU tests: JAXSTITCH_TEST_SEED={RUN_SEED} on {jax.devices()[0].device_kind}")


# ----------------------------------------------------------------------------------------------------
# comparison
# ----------------------------------------------------------------------------------------------------

def compare(got, want, what, scale_ref=None, lossy=None, slack=0.0):
    """`scale_ref`: another output whose magnitude also counts as the scale (the graph's abs variant);
    `lossy`: the coarsest dtype a computed value was rounded to; `slack`: an absolute bound on how far
    the output may move when such roundings are skipped (XLA's excess precision on GPUs)."""
    g, w = np.asarray(got), np.asarray(want)
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    assert g.dtype == w.dtype, f"{what}: dtype {g.dtype} != {w.dtype}"
    if not jnp.issubdtype(w.dtype, jnp.floating):
        mism = int(np.sum(g != w))
        assert mism == 0, f"{what}: {mism} of {w.size} {w.dtype} elements differ"
        return
    g32, w32 = g.astype(np.float32), w.astype(np.float32)
    new_nan = np.isnan(g32) & ~np.isnan(w32)
    assert not new_nan.any(), f"{what}: {int(new_nan.sum())} NaNs where the reference has none"
    new_inf = np.isinf(g32) & ~np.isinf(w32)
    assert not new_inf.any(), f"{what}: {int(new_inf.sum())} infs where the reference has none"
    both = np.isfinite(g32) & np.isfinite(w32)
    scale = float(np.max(np.abs(w32[both]), initial=0.0))
    if scale_ref is not None:
        s32 = np.asarray(scale_ref).astype(np.float32)
        scale = max(scale, float(np.max(np.abs(s32[np.isfinite(s32)]), initial=0.0)))
    err = float(np.max(np.abs(g32[both] - w32[both]), initial=0.0))
    tol = TOL[coarser(np.dtype(w.dtype).name, lossy)]
    if err > tol * max(scale, 1e-30) + 2 * slack:
        idx = np.unravel_index(np.argmax(np.where(both, np.abs(g32 - w32), -1)), w32.shape)
        pytest.fail(f"{what}: max error {err:.3g} = {err / max(scale, 1e-30):.3g} of max |ref| {scale:.3g} "
                    f"> {tol:g} (+ slack {2 * slack:.3g}); worst at {idx}: got {g32[idx]!r}, want {w32[idx]!r}")


def run_stitched(fn, args, what):
    """RUNS calls of jaxstitch.jit(fn) on the same inputs: they must agree bit for bit."""
    f = jaxstitch.jit(fn)
    outs = [jax.block_until_ready(f(*args)) for _ in range(RUNS)]
    _same_bits(outs, what)
    return f, outs[0]


def _same_bits(outs, what):
    """Results of repeated calls on the same inputs must agree bit for bit (else a race)."""
    first = jax.tree.leaves(outs[0])
    for k, o in enumerate(outs[1:], 2):
        for i, (a, b) in enumerate(zip(first, jax.tree.leaves(o))):
            a, b = np.asarray(a), np.asarray(b)
            if a.tobytes() != b.tobytes():
                diff = int(np.sum(a.view(np.uint8) != b.view(np.uint8)))
                pytest.fail(f"{what}: output {i} differs between run 1 and run {k} ({diff} bytes): a race")


# ----------------------------------------------------------------------------------------------------
# workloads
# ----------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _template(name, dtype):
    """The quick-shape inputs, only for their structure (which argument is a row, a column, labels...)."""
    return WORKLOADS[name].make_inputs(jax.random.key(0), DTYPES[dtype], True)


def _row_structured(name, dtype) -> bool:
    """Whether every input is the [N, C] array's shape, a [C] column, labels or a key (else the
    workload draws its own inputs: the rotary angles are [N, 64])."""
    t = _template(name, dtype)
    n, c = t[0].shape
    return all(a.shape in ((n, c), (c,)) or not jnp.issubdtype(a.dtype, jnp.floating) for a in t)


def workload_inputs(name, dtype, shape, seed):
    """Fresh inputs of the workload's structure for a main [N, C] array of `shape`. Workloads of
    another structure (the attention's [B, T, D], the optimizer's parameter list) draw their own,
    from a key made from `seed`."""
    if len(shape) != 2 or not _row_structured(name, dtype):
        return list(WORKLOADS[name].draw(jax.random.key(seed % (1 << 32)), DTYPES[dtype], *shape))
    n, c = shape
    rng = np.random.default_rng(seed)
    out = []
    for a in _template(name, dtype):
        if a.dtype == jnp.uint32:  # a raw PRNG key
            out.append(jnp.asarray(rng.integers(0, 1 << 32, a.shape, dtype=np.uint64).astype(np.uint32)))
        elif jnp.issubdtype(a.dtype, jnp.integer):  # labels [N] in [0, C)
            out.append(jnp.asarray(rng.integers(0, c, (n,)), a.dtype))
        else:
            shp = (n, c) if a.ndim == 2 else (c,)  # every 1-D float input of the suite is a column param
            scale = 2.0 if name == "xent_fwdbwd" else 1.0
            x = (scale * rng.standard_normal(shp)).astype(np.float32)
            x[x == 0] = 1.0
            out.append(jnp.asarray(x, a.dtype))
    return out


def _workload_params():
    out = []
    for name, w in WORKLOADS.items():
        for dtype in DTYPES:
            for label, shape in (("quick", tuple(w.quick_shape)), ("odd", ODD_SHAPES[name])):
                out.append(pytest.param(name, dtype, shape, id=f"{name}-{dtype}-{label}{'x'.join(map(str, shape))}"))
    return out


def _decided_rows(name, args, got, want):
    """The rows to compare, or None for all. The top-p filter keeps a token when the mass before it
    is below TOP_P; float32 sums in another order may decide a token whose mass before it is that
    close to TOP_P either way, and the row's renormalization moves with the decision. Decisions
    (nonzero outputs) must agree except within 1e-4 of TOP_P (float64 mass), and in 90% of the rows;
    the rows where they agree are compared."""
    if name != "top_p_filter":
        return None
    x = np.asarray(args[0]).astype(np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    near = np.abs(np.cumsum(p, -1) - p - TOP_P) < 1e-4
    differ = (np.asarray(got, np.float32) != 0) != (np.asarray(want, np.float32) != 0)
    assert not (differ & ~near).any(), f"{name}: {int((differ & ~near).sum())} tokens kept by one only, far from TOP_P"
    rows = ~differ.any(-1)
    assert rows.mean() >= 0.9, f"{name}: decisions differ in {1 - rows.mean():.0%} of rows"
    return rows


def check_workload(name, dtype, shape, forced):
    fn = WORKLOADS[name].fn
    seed = (RUN_SEED + zlib.crc32(f"{name}/{dtype}/{shape}/{forced}".encode())) % (1 << 63)
    args = workload_inputs(name, dtype, shape, seed)
    what = _msg(f"{name} {dtype} {shape}{' forced' if forced else ''}", seed)
    with jax.default_matmul_precision("float32") if name in FULL_PRECISION else contextlib.nullcontext():
        want = jax.block_until_ready(jax.jit(fn)(*args))
        f, got = run_stitched(fn, args, what)
    compare_outputs(name, dtype, args, got, want, what)
    report = jaxstitch.explain(fn, *args)
    if report.stitched_kernels:
        text = f.lower(*args).as_text()
        launches = text.count(ffi.TARGET) + text.count(xla_kernel.TARGET)
        assert launches >= report.stitched_kernels, (
            f"{what}: explain says {report.stitched_kernels} stitched kernels, the HLO launches "
            f"{launches}\n{report}")
    return report


def compare_outputs(name, dtype, args, got, want, what):
    """A workload's outputs against jax.jit's: the rows its decisions made alike (_decided_rows), and
    a recurrent one's half-precision outputs against float32 with XLA's own error as slack."""
    fn = WORKLOADS[name].fn
    lw, lg = jax.tree.leaves(want), jax.tree.leaves(got)
    assert len(lw) == len(lg)
    rows = _decided_rows(name, args, lg[0], lw[0])
    if name in RECURRENT and dtype != "float32":
        wide = [a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]
        with jax.default_matmul_precision("float32"):
            exact = jax.tree.leaves(jax.block_until_ready(jax.jit(fn)(*wide)))
        for i, (a, b, r) in enumerate(zip(lg, lw, exact)):
            xla_off = float(np.max(np.abs(np.asarray(b, np.float32) - np.asarray(r, np.float32)), initial=0.0))
            compare(a, np.asarray(r).astype(np.asarray(a).dtype), f"{what} output {i} against float32",
                    slack=xla_off)
    else:
        for i, (a, b) in enumerate(zip(lg, lw)):
            if rows is not None:
                a, b = np.asarray(a)[rows], np.asarray(b)[rows]
            compare(a, b, f"{what} output {i}")


@pytest.mark.parametrize("name,dtype,shape", _workload_params())
def test_workload_matches_xla(name, dtype, shape):
    check_workload(name, dtype, shape, forced=False)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name,shape", [("softmax_fwdbwd", (49152, 512)), ("softmax_fwdbwd", (16411, 999))])
def test_one_wave_grids_match_xla(monkeypatch, name, shape, dtype):
    """JAXSTITCH_TUNE=one_wave=1 (mapping.one_wave): row kernels launched as one wave of resident
    blocks, each walking more row groups, give jax.jit's results; the knob did shrink a grid."""
    planned = [r.grid for r in jaxstitch.explain(WORKLOADS[name].fn, *workload_inputs(name, dtype, shape, 0)).regions]
    monkeypatch.setenv("JAXSTITCH_TUNE", "one_wave=1")
    report = check_workload(name, dtype, shape, forced=False)
    assert any(r.stitched and r.grid < g for r, g in zip(report.regions, planned)), str(report)


@pytest.mark.parametrize("stages", [3, 4])
@pytest.mark.parametrize("name,dtype,shape", [
    ("rmsnorm_residual_fwdbwd", "bfloat16", (4096, 768)),  # dw's grid barrier after the row loop
    ("layernorm_fwdbwd", "float32", (2051, 1024)),          # rows not a multiple of the groups
    ("softmax_fwdbwd", "float32", (16411, 700)),
    ("softmax_fwdbwd", "float32", (37, 1024)),             # fewer row groups than buffers in flight
])
def test_stage_rings_match_xla(monkeypatch, name, dtype, shape, stages):
    """JAXSTITCH_TUNE=stages=3 or 4: row groups loaded through a ring of that many async-copy
    buffers (STAGES - 1 groups in flight, lowering/codegen.py) give jax.jit's results."""
    monkeypatch.setenv("JAXSTITCH_TUNE", f"stages={stages}")
    with force_stitching():  # (37 x 1024 is launch-bound: the cost model leaves it to XLA)
        report = check_workload(name, dtype, shape, forced=True)
    assert any(f"{stages}-stage" in (r.mapping or "") for r in report.regions if r.stitched), str(report)


@pytest.mark.parametrize("name", ["softmax_fwdbwd", "adamw_bert", "dien_attention_fwdbwd", "layernorm_fwdbwd"])
def test_launches_outside_command_buffers_match_xla(monkeypatch, name):
    """JAXSTITCH_TUNE=cmd_buffers=0: the same kernels launched through the handler registered
    without XLA's command-buffer trait (integration/ffi.py TARGET_PLAIN): a row, a remote, a tile and
    a grid-barrier kernel (layernorm's dgamma and dbeta beside dx) give jax.jit's results, and the
    compiled program calls only that target."""
    monkeypatch.setenv("JAXSTITCH_TUNE", "cmd_buffers=0")
    shape = tuple(WORKLOADS[name].quick_shape)
    # (DIEN's attention at its quick shape in bfloat16 is launch-bound: forced; the others as planned,
    # adamw_bert's updates as one remote kernel)
    forced = name == "dien_attention_fwdbwd"
    with force_stitching() if forced else contextlib.nullcontext():
        check_workload(name, "bfloat16", shape, forced=forced)
        args = workload_inputs(name, "bfloat16", shape, 0)
        text = jaxstitch.jit(WORKLOADS[name].fn).lower(*args).compile().as_text()
    assert ffi.TARGET_PLAIN in text and f'"{ffi.TARGET}"' not in text, name


# (workload, dtype) whose quick shape has a kernel XLA's own call can run (tests/test_xla_kernel.py
# checks which on the CPU): rows in registers, packed short rows, chunked long rows with a shared
# stash, a tile kernel, a persistent scan beside a launcher kernel.
XLA_KERNEL_CASES = [(n, d) for n in ("softmax_fwdbwd", "softmax_fwdbwd_short", "dien_attention_fwdbwd",
                                     "gelu_layernorm", "attention_softmax_bwd", "dien_gru_fwdbwd")
                    for d in DTYPES] + [("softmax_fwdbwd_long", "bfloat16")]


@pytest.mark.parametrize("name,dtype", XLA_KERNEL_CASES)
def test_xla_kernel_calls_match_xla(monkeypatch, name, dtype):
    """JAXSTITCH_TUNE=xla_kernels=1: kernels run as XLA's own kernel call (PTX with the row count
    fixed, kernels/xla_kernel.py) give jax.jit's results. XLA's call cannot poison its results, so
    the allocator's free memory is filled with NaN first and ours runs before the reference: an
    element the kernel never writes reads NaN."""
    monkeypatch.setenv("JAXSTITCH_TUNE", "xla_kernels=1")
    monkeypatch.setenv("JAXSTITCH_POISON", "0")
    fn, shape = WORKLOADS[name].fn, tuple(WORKLOADS[name].quick_shape)
    seed = (RUN_SEED + zlib.crc32(f"xla_kernels/{name}/{dtype}".encode())) % (1 << 63)
    args = workload_inputs(name, dtype, shape, seed)
    what = _msg(f"{name} {dtype} {shape} as XLA kernel calls", seed)
    precision = "float32" if name in FULL_PRECISION else None  # (as check_workload's)
    # (forced: at the quick shapes in bfloat16 some regions are launch-bound, left to XLA)
    with jax.default_matmul_precision(precision), force_stitching():
        compiled = jaxstitch.jit(fn).lower(*args).compile()
    assert xla_kernel.TARGET in compiled.as_text(), what
    out_bytes = sum(o.size * o.dtype.itemsize for o in jax.tree.leaves(jax.eval_shape(fn, *args)))
    junk = [jnp.full((out_bytes // 4 + 4096,), jnp.nan, jnp.float32) for _ in range(4)]
    jax.block_until_ready(junk)
    del junk
    outs = [jax.block_until_ready(compiled(*args)) for _ in range(RUNS)]
    _same_bits(outs, what)
    with jax.default_matmul_precision(precision):
        want = jax.block_until_ready(jax.jit(fn)(*args))
    compare_outputs(name, dtype, args, outs[0], want, what)


def test_xla_kernel_call_with_one_buffer_twice(monkeypatch):
    """Two matrix products of the same operands feed one region (softmax forward and backward); XLA's
    CSE merges them, so its kernel call gets one buffer as two operands. Some XLA versions pass such an argument once
    (CustomKernelThunk skipping `first_with_same_slice`), which would shift our kernel's pointers;
    this checks the installed one against jax.jit."""
    monkeypatch.setenv("JAXSTITCH_TUNE", "xla_kernels=1")
    monkeypatch.setenv("JAXSTITCH_POISON", "0")

    def fn(x, w):
        a, b = x @ w, x @ w  # (two dot_generals in the jaxpr: JAX does not merge them)
        return WORKLOADS["softmax_fwdbwd"].fn(a, b)

    seed = (RUN_SEED + zlib.crc32(b"xla_kernels/one buffer twice")) % (1 << 63)
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (4096, 256), jnp.float32)
    w = jax.random.normal(kw, (256, 1024), jnp.float32) / 16
    what = _msg("one buffer as two operands of XLA's kernel call", seed)
    with jax.default_matmul_precision("float32"):
        compiled = jaxstitch.jit(fn).lower(x, w).compile()
        assert xla_kernel.TARGET in compiled.as_text(), what
        got = jax.block_until_ready(compiled(x, w))
        want = jax.block_until_ready(jax.jit(fn)(x, w))
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        compare(np.asarray(a), np.asarray(b), f"{what} output {i}")


@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_workload_forced_stitching_matches_xla(name, dtype):
    """Every plannable region stitched, also those the cost model leaves to XLA."""
    with force_stitching():
        check_workload(name, dtype, tuple(WORKLOADS[name].quick_shape), forced=True)


# Rows longer than a block holds in registers: walked in chunks, inputs stashed in shared memory between
# phases, or (when the row does not fit there either) read again from global memory.
LONG_ROWS = [  # (workload, dtype, shape, what the mapping must say)
    # enough rows to fill the GPU: a block per row, walked in chunks, stashed in shared or global memory
    ("softmax_fwdbwd", "bfloat16", (300, 20000), r"\d+ chunks, shared stash"),
    ("softmax_fwdbwd", "float32", (270, 60001), r"\d+ chunks, global stash"),
    ("layernorm_fwd", "float32", (280, 30000), r"\d+ chunks, shared stash"),
    ("xent_fwdbwd", "bfloat16", (300, 32000), r"\d+ chunks, shared stash"),
    # two rows to an SM: the stash holds 3 of 4 chunks, the 4th is read from global memory each pass
    ("softmax_fwdbwd", "bfloat16", (300, 32000), r"\d+ chunks, shared stash of \d+"),  # two inputs
    ("xent_fwdbwd", "float32", (300, 32000), r"\d+ chunks, shared stash of \d+"),
    # few rows: each split over blocks, partial reductions combined past their row's barriers
    ("softmax_fwdbwd", "bfloat16", (61, 20000), r"rows split over \d+ blocks"),
    ("softmax_fwdbwd", "float32", (37, 60001), r"rows split over \d+ blocks"),
    ("layernorm_fwd", "float32", (5, 30001), r"rows split over \d+ blocks"),  # slices in registers
    ("xent_fwdbwd", "float32", (47, 60000), r"rows split over \d+ blocks"),   # and a grid-wide sum
    ("xent_fwdbwd", "bfloat16", (3, 120000), r"rows split over \d+ blocks"),
    # a 48 KiB stash next to static shared memory: the launcher must opt in above 48 KiB in all
    ("softmax_fwdbwd", "float32", (5, 40000), r"rows split over \d+ blocks"),
    # a task per SM, one round (forced: 4 slices): part of each slice stashed, the rest read through L2
    ("softmax_fwdbwd", "float32", (31, 262144), r"rows split over 4 blocks, 8 chunks, shared stash of 3"),
    # twice the slices in two rounds of a block an SM, 3 of 4 chunks stashed (mapping._stash_in_rounds)
    ("softmax_fwdbwd", "float32", (32, 262144), r"rows split over 8 blocks, 4 chunks, shared stash of 3"),
    # half precision: two tasks per SM with the same share stashed (mapping._two_per_sm_same_share)
    ("softmax_fwdbwd", "bfloat16", (33, 262144), r"rows split over 8 blocks, 4 chunks, shared stash of 3"),
    # more (row, slice) tasks than resident blocks (forced: 32 slices): rounds of whole rows
    ("softmax_fwdbwd", "bfloat16", (33, 262145), r"rows split over 32 blocks"),
]
SPLITS_TUNE = {(33, 262145): "splits=32", (31, 262144): "splits=4"}  # (elsewhere the planner chooses)


@pytest.mark.parametrize("name,dtype,shape,mapping", LONG_ROWS,
                         ids=[f"{n}-{d}-{s[0]}x{s[1]}" for n, d, s, _ in LONG_ROWS])
def test_long_rows_match_xla(name, dtype, shape, mapping, monkeypatch):
    if shape in SPLITS_TUNE:
        monkeypatch.setenv("JAXSTITCH_TUNE", SPLITS_TUNE[shape])
    with force_stitching():
        report = check_workload(name, dtype, shape, forced=True)
    assert any(r.stitched and re.search(mapping, r.mapping or "") for r in report.regions), str(report)


# Batches of small tiles (plan/tile.py): reductions along both tile axes and over the whole tile in one
# kernel. Tile widths below a warp (lanes grouped per row of the tile), wider than a warp, and DIEN's;
# 150 rows: the softmax statistics' epoch in one warp without slots (test_tile_one_warp.py). DIEN's
# at 6000 tiles: more than one wave of blocks (or of warps, a warp on each tile) holds, so each walks
# several, the next one's inputs copied while this one is worked on.
TILE_SHAPES = [(257, 20, 12), (64, 7, 200), (6000, 50, 36), (96, 150, 24)]


def tile_mix(x, w):
    """Sums along b, maxima and minima along a, a whole-tile sum, and a full-size output of them."""
    s = jnp.sum(x, axis=2)
    t = jnp.max(x, axis=1)
    tot = jnp.sum(x.astype(jnp.float32) ** 2, axis=(1, 2))
    y = x * s[..., None] / (tot[:, None, None] + 1.0).astype(x.dtype) + t[:, None, :]
    return y, s * w, tot, jnp.min(x * w[..., None], axis=1)


@pytest.mark.parametrize("teams", [1, 4])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", TILE_SHAPES, ids=["x".join(map(str, s)) for s in TILE_SHAPES])
def test_tile_kernels_match_xla(shape, dtype, teams, monkeypatch):
    """teams=1: a block on each tile; 4: a warp on each of four (plan/tile.TILE_TEAMS)."""
    monkeypatch.setenv("JAXSTITCH_TUNE", f"teams={teams}")
    seed = (RUN_SEED + zlib.crc32(f"tiles/{shape}/{dtype}/{teams}".encode())) % (1 << 63)
    rng = np.random.default_rng(seed)
    b, ta, tb = shape
    dt = DTYPES[dtype]
    x = jnp.asarray(rng.standard_normal(shape), dt)
    w = jnp.asarray(rng.standard_normal((b, ta)), dt)
    mask = jnp.asarray(rng.random((b, ta)) < 0.8)
    q, dout = (jnp.asarray(rng.standard_normal((b, tb)), dt) for _ in range(2))
    cases = [(tile_mix, (x, w)), (WORKLOADS["dien_attention_fwdbwd"].fn, (x, q, mask, dout)),
             (stats_read_later, (x,))]
    for fn, args in cases:
        what = _msg(f"{fn.__name__} {dtype} {shape}", seed)
        with force_stitching():
            report = jaxstitch.explain(fn, *args)
            assert any(r.stitched and "tile" in (r.mapping or "") for r in report.regions), str(report)
            want = jax.block_until_ready(jax.jit(fn)(*args))
            _, got = run_stitched(fn, args, what)
        for i, (a, c) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
            compare(a, c, f"{what} output {i}")


def _independent_chains(a, b, c, d, e, s):
    """Five chains with no path between them, of three op structures, sizes that are not multiples
    of a vector (4 float32) or of a task (4096 elements), and float, half, int and bool values."""
    return (a * s + 1.0, b * s + 1.0, (c * 3 + 1) % 7, jnp.where(d > 0, d, s).astype(jnp.bfloat16),
            jnp.logical_not(e), a.size * s)


REMOTE_SHAPES = [(1000, 3), (4097,), (3, 4096, 2), (5,), (777,)]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_remote_kernels_match_xla(dtype):
    seed = (RUN_SEED + zlib.crc32(f"remote/{dtype}".encode())) % (1 << 63)
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    sa, sb, sc, sd, se = REMOTE_SHAPES
    args = (jnp.asarray(rng.standard_normal(sa), dt), jnp.asarray(rng.standard_normal(sb), dt),
            jnp.asarray(rng.integers(-1000, 1000, sc), jnp.int32), jnp.asarray(rng.standard_normal(sd), jnp.float32),
            jnp.asarray(rng.random(se) < 0.5), jnp.asarray(rng.standard_normal(()), dt))
    what = _msg(f"independent chains {dtype}", seed)
    report = jaxstitch.explain(_independent_chains, *args)
    assert any(r.stitched and r.scheme == "remote" for r in report.regions), str(report)
    want = jax.block_until_ready(jax.jit(_independent_chains)(*args))
    _, got = run_stitched(_independent_chains, args, what)
    for i, (a, c) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        compare(a, c, f"{what} output {i}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_updates_of_column_sums_match_xla(dtype):
    """A stitched region's column sums, each read by an update beside the optimizer state: the sums'
    kernel, then the updates as one remote kernel, against jax.jit."""
    seed = (RUN_SEED + zlib.crc32(f"bias-adam/{dtype}".encode())) % (1 << 63)
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    args = [jnp.asarray(rng.standard_normal((1000, 777)), dt)]
    args += [jnp.asarray(rng.standard_normal(777) * s, dt) for s in (0.1, 1.0, 1.0) * 2]
    args[2], args[5] = jnp.abs(args[2]), jnp.abs(args[5])  # second moments are not negative
    what = _msg(f"column sums then Adam {dtype}", seed)
    # (the sums forced: 3 MB in bfloat16 are launch-bound; the updates stay the cost model's)
    with force_stitching(lambda region: any(op.prim == "reduce_sum" for op in region.ops)):
        report = jaxstitch.explain(bias_grads_then_adam, *args)
        assert [r.scheme for r in report.regions if r.stitched] == ["global", "remote"], str(report)
        want = jax.block_until_ready(jax.jit(bias_grads_then_adam)(*args))
        _, got = run_stitched(bias_grads_then_adam, args, what)
    for i, (a, c) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        compare(a, c, f"{what} output {i}")


def test_updates_written_over_donated_state_match_xla(monkeypatch):
    """With the state donated (and no poisoning, which would fill it), the remote kernel writes each
    update over the state it read: its results against jax.jit's, and no more launches than
    without donation (XLA would otherwise copy each result into its donated buffer)."""
    from jaxstitch.bench.runner import count_kernels

    monkeypatch.setenv("JAXSTITCH_POISON", "0")
    seed = (RUN_SEED + zlib.crc32(b"donated-adam")) % (1 << 63)
    rng = np.random.default_rng(seed)
    args = [jnp.asarray(rng.standard_normal((1000, 777)), jnp.float32)]
    args += [jnp.asarray(np.abs(rng.standard_normal(777)) * s, jnp.float32) for s in (0.1, 1.0, 1.0) * 2]
    what = _msg("column sums then Adam, donated", seed)
    want = jax.block_until_ready(jax.jit(bias_grads_then_adam)(*args))
    donated = jaxstitch.jit(bias_grads_then_adam, donate_argnums=(1, 2, 3, 4, 5, 6))
    hlo = donated.lower(*args).compile().as_text()
    assert "output_to_operand_aliasing" in hlo, hlo
    kept = count_kernels(jaxstitch.jit(bias_grads_then_adam).lower(*args).compile().as_text())
    assert count_kernels(hlo) <= kept, (count_kernels(hlo), kept)
    for _ in range(RUNS):  # (each call consumes its state: fresh copies)
        got = jax.block_until_ready(donated(args[0], *[jnp.array(a, copy=True) for a in args[1:]]))
        for i, (a, c) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
            compare(a, c, f"{what} output {i}")


def _count_params():
    out = []
    for name in WORKLOADS:
        for dtype in DTYPES:
            marks = [pytest.mark.xfail(strict=True, reason=KNOWN_PLAN_BUGS[name])] \
                if name in KNOWN_PLAN_BUGS else []
            out.append(pytest.param(name, dtype, marks=marks, id=f"{name}-{dtype}"))
    return out


@pytest.mark.parametrize("name,dtype", _count_params())
def test_explain_detects_gpu_and_counts_kernels(name, dtype):
    w = WORKLOADS[name]
    args = workload_inputs(name, dtype, tuple(w.quick_shape), RUN_SEED)
    report = jaxstitch.explain(w.fn, *args)  # no target: the local GPU's
    kind = jax.devices()[0].device_kind.lower()
    assert report.target in kind.replace(" ", "") or report.target.lower() in kind, (report.target, kind)
    for r in report.regions:
        assert r.stitched or (r.reason and r.reason.strip()), str(report)
        assert not (r.reason or "").startswith(("NVRTC", "codegen")), str(report)
    if name in ONE_KERNEL:
        assert report.stitched_kernels == 1, str(report)
    if name == "bias_gelu_dropout":  # GELU's erf stitched with the dropout's threefry bits written out
        ew = [r for r in report.regions if {"erf", "erfc"} & set(r.ops)]  # (bench: 3 kernels -> 1, 1.2-1.4x)
        assert ew and all(r.stitched and "xor" in r.ops for r in ew), str(report)


def _heavy(v):
    v = v - jnp.max(v, axis=-1, keepdims=True)
    v = v - jnp.mean(v, axis=-1, keepdims=True)
    return v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + 1e-5)


def unit_sum_output(x, w):
    return _heavy(x) * w, jnp.sum((w * 2.0)[None, :], axis=0)


def test_size1_reduction_output_is_written():
    seed = RUN_SEED % (1 << 32)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((4096, 1024)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(1024), jnp.float32)
    assert jaxstitch.explain(unit_sum_output, x, w).stitched_kernels == 1
    want = jax.jit(unit_sum_output)(x, w)
    _, got = run_stitched(unit_sum_output, (x, w), _msg("unit_sum_output", seed))
    for i, (a, b) in enumerate(zip(got, want)):
        compare(a, b, _msg(f"unit_sum_output output {i}", seed))


# ----------------------------------------------------------------------------------------------------
# random region graphs
# ----------------------------------------------------------------------------------------------------

GRAPH_SETTINGS = dict(max_examples=int(os.environ.get("JAXSTITCH_GPU_EXAMPLES", "40")), deadline=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                             HealthCheck.data_too_large])


def check_random_graph(example, forced: bool):
    fn, specs, seed = example
    args = random_inputs(specs, seed)
    what = f"{fn!r}\n(input seed {seed})"
    want = jax.block_until_ready(jax.jit(fn)(*args))
    scale = jax.jit(fn.abs_variant())(*args)
    with force_stitching() if forced else contextlib.nullcontext():
        report = jaxstitch.explain(fn, *specs)
        event(f"stitched kernels: {report.stitched_kernels}")
        event(f"remote kernels: {sum(r.stitched and r.scheme == 'remote' for r in report.regions)}")
        _, got = run_stitched(fn, args, what)
    lw, lg, ls = jax.tree.leaves(want), jax.tree.leaves(got), jax.tree.leaves(scale)
    assert len(lw) == len(lg)
    for i, (a, b, s) in enumerate(zip(lg, lw, ls)):
        compare(a, b, f"{what} output {i}", scale_ref=s, lossy=fn.lossy_dtype, slack=fn.out_err[i])


@settings(**GRAPH_SETTINGS)
@given(region_graphs(max_elems=1 << 20, exclude=KNOWN_WRONG_RESULT_FEATURES))
def test_random_graphs_match_xla(example):
    """Random graphs with every plannable region stitched (most are small one-pass regions the cost
    model would leave to XLA, which would test nothing of ours)."""
    check_random_graph(example, forced=True)


@settings(**GRAPH_SETTINGS)
@given(region_graphs(max_elems=1 << 20, exclude=KNOWN_WRONG_RESULT_FEATURES))
def test_random_graphs_as_planned_match_xla(example):
    """The same graphs as the cost model plans them: the one-pass regions it leaves to XLA are where
    remote stitching launches independent ones together."""
    check_random_graph(example, forced=False)


def grid_sums_broadcast(x):
    """Outputs that are grid-wide or column sums broadcast back to [N, C] (found by the random graphs:
    only their first element was once written)."""
    xf = x.astype(jnp.float32)
    return xf * 2.0, jnp.broadcast_to(jnp.sum(xf), x.shape), jnp.broadcast_to(jnp.sum(xf, axis=0), x.shape)


@pytest.mark.parametrize("shape", [(1, 3), (37, 129), (300, 64)])
def test_grid_sums_broadcast_as_outputs(shape):
    seed = (RUN_SEED + zlib.crc32(repr(shape).encode())) % (1 << 63)
    x = jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.bfloat16)
    what = _msg(f"grid_sums_broadcast {shape}", seed)
    want = jax.jit(grid_sums_broadcast)(x)
    with force_stitching():
        assert jaxstitch.explain(grid_sums_broadcast, x).stitched_kernels >= 1
        _, got = run_stitched(grid_sums_broadcast, (x,), what)
    for i, (a, b) in enumerate(zip(got, want)):
        compare(a, b, f"{what} output {i}")


def norm_bwd_sums(x, dy):
    """A layernorm backward's column sums (dgamma, dbeta) beside a row-wise output: the grid-wide
    column finish that planner.column_group shapes."""
    xf, dyf = x.astype(jnp.float32), dy.astype(jnp.float32)
    xhat = xf - jnp.mean(xf, axis=-1, keepdims=True)
    dx = dyf - xhat * jnp.mean(dyf * xhat, axis=-1, keepdims=True)
    return dx.astype(x.dtype), jnp.sum(dyf * xhat, axis=0), jnp.sum(dyf, axis=0).astype(x.dtype)


@pytest.mark.parametrize("group", [0, 1, 4, 32])
@pytest.mark.parametrize("shape", [(4096, 771), (300, 64), (2053, 3)])
def test_column_groups_match_xla(monkeypatch, group, shape):
    """Column sums finished in groups of 1 to 32 columns a block (col_group=0: the planner's choice),
    columns not a multiple of the group, against jax.jit."""
    seed = (RUN_SEED + zlib.crc32(repr(("colgroup", shape)).encode())) % (1 << 63)
    rng = np.random.default_rng(seed)
    args = [jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(2)]
    what = _msg(f"norm_bwd_sums {shape} col_group={group}", seed)
    want = jax.jit(norm_bwd_sums)(*args)
    monkeypatch.setenv("JAXSTITCH_TUNE", f"col_group={group}")
    with force_stitching():
        assert jaxstitch.explain(norm_bwd_sums, *args).stitched_kernels >= 1
        _, got = run_stitched(norm_bwd_sums, args, what)
    for i, (a, b) in enumerate(zip(got, want)):
        compare(a, b, f"{what} output {i}")


def divide_rows(x, y, s):
    """Divisions of the two kinds a kernel has: element by element, and every element of a row over
    one divisor (whose reciprocal the kernel computes once per row). Both must round as XLA's."""
    return x / y, x / s[:, None], jnp.sum(x, axis=-1)


def test_divisions_round_like_xla():
    seed = (RUN_SEED + zlib.crc32(b"divide_rows")) % (1 << 63)
    rng = np.random.default_rng(seed)
    n, c = 512, 1000

    def wide(shape, lo, hi):  # magnitudes over much of the float range, subnormals and overflow too
        return rng.standard_normal(shape) * np.exp2(rng.integers(lo, hi, shape).astype(np.float64))

    x, y, s = wide((n, c), -140, 127), wide((n, c), -140, 127), wide(n, -70, 70)
    x[: n // 2], y[: n // 2] = rng.standard_normal((n // 2, c)), rng.standard_normal((n // 2, c))
    x[n // 2, 0], x[n // 2 + 1, 1], x[n // 2 + 2, 2] = 0.0, np.inf, -0.0
    s[0], s[1], s[2] = 3.0, 1e-40, 3e38  # a subnormal divisor, and one above 2^126
    x, y, s = (jnp.asarray(a, jnp.float32) for a in (x, y, s))
    what = _msg("divide_rows", seed)
    want = jax.jit(divide_rows)(x, y, s)
    with force_stitching():
        assert jaxstitch.explain(divide_rows, x, y, s).stitched_kernels == 1
        _, got = run_stitched(divide_rows, (x, y, s), what)
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(want[i]), err_msg=f"{what} output {i}")


def int_div_rem(a, b):
    """lax.div / lax.rem on int32 with XLA's answers where C's are undefined (x / 0 = -1, x % 0 = x,
    INT_MIN / -1 = INT_MIN, INT_MIN % -1 = 0)."""
    return jax.lax.div(a, b), jax.lax.rem(a, b)


def test_integer_division_matches_xla():
    seed = (RUN_SEED + zlib.crc32(b"int_div_rem")) % (1 << 63)
    rng = np.random.default_rng(seed)
    a = rng.integers(-2**31, 2**31, (64, 300), dtype=np.int64).astype(np.int32)
    b = rng.integers(-5, 6, (64, 300)).astype(np.int32)  # zeros and -1 among them
    a[0, :4], b[0, :4] = np.iinfo(np.int32).min, [-1, 0, 1, -1]
    a, b = jnp.asarray(a), jnp.asarray(b)
    what = _msg("int_div_rem", seed)
    want = jax.jit(int_div_rem)(a, b)
    with force_stitching():
        assert jaxstitch.explain(int_div_rem, a, b).stitched_kernels == 1
        _, got = run_stitched(int_div_rem, (a, b), what)
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(want[i]), err_msg=f"{what} output {i}")


def softmax_and_log(x):
    """A softmax and a log-softmax: both reduce max and sum of exp in one pass (plan/online.py)."""
    return jax.nn.softmax(x, axis=-1), jax.nn.log_softmax(x, axis=-1)


def _special_rows(rng, n, c):
    """Rows that test the online max and sum: all -inf (NaN, as two passes give), mostly -inf (the
    running max starts at -inf), one +inf, one NaN, a max that grows in every chunk or only at the start."""
    x = rng.standard_normal((n, c)) * 10
    x[0] = -np.inf
    x[1, : 3 * c // 4] = -np.inf
    x[2, c // 2] = np.inf
    x[3, c // 3] = np.nan
    x[4] = np.linspace(-50, 50, c)
    x[5] = np.linspace(50, -50, c)
    x[6, -1] = 80.0
    return x


@pytest.mark.parametrize("c", [64, 1000, 40000])
def test_online_softmax_special_rows_match_xla(c):
    seed = (RUN_SEED + zlib.crc32(f"online{c}".encode())) % (1 << 63)
    x = jnp.asarray(_special_rows(np.random.default_rng(seed), 64, c), jnp.float32)
    what = _msg(f"softmax_and_log over {c} columns", seed)
    want = jax.jit(softmax_and_log)(x)
    with force_stitching():
        report = jaxstitch.explain(softmax_and_log, x)
        assert report.stitched_kernels == 1 and "online" in report.regions[0].mapping
        _, got = run_stitched(softmax_and_log, (x,), what)
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f"{what} output {i}: NaN positions")
        compare(a, b, f"{what} output {i}")


def logsumexp_and_grad(x):
    """jax.nn.logsumexp's shift is the max only where finite (0 elsewhere): its online sum has other
    special rows than a softmax's (a +inf max sums to +inf, a row of -inf to 0)."""
    return jax.value_and_grad(lambda z: jnp.sum(jax.nn.logsumexp(z, axis=-1)))(x)


@pytest.mark.parametrize("c", [64, 1000, 40000])
def test_online_logsumexp_special_rows_match_xla(c):
    seed = (RUN_SEED + zlib.crc32(f"online_lse{c}".encode())) % (1 << 63)
    x = jnp.asarray(_special_rows(np.random.default_rng(seed), 64, c), jnp.float32)
    what = _msg(f"logsumexp_and_grad over {c} columns", seed)
    lse = jax.jit(lambda z: jax.nn.logsumexp(z, axis=-1))(x)
    want = jax.jit(logsumexp_and_grad)(x)
    with force_stitching():
        report = jaxstitch.explain(logsumexp_and_grad, x)
        assert any("online" in (r.mapping or "") for r in report.regions if r.stitched), report
        got_lse = jaxstitch.jit(lambda z: jax.nn.logsumexp(z, axis=-1))(x)
        _, got = run_stitched(logsumexp_and_grad, (x,), what)
    got_lse, lse = np.asarray(got_lse), np.asarray(lse)
    special = ~np.isfinite(lse) | ~np.isfinite(got_lse)  # (+inf, -inf and NaN rows exactly; the rest rounds)
    np.testing.assert_array_equal(got_lse[special], lse[special], err_msg=f"{what}: the sums' inf/NaN rows")
    compare(got_lse[~special], lse[~special], f"{what}: logsumexp")
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f"{what} output {i}: NaN positions")
        compare(a, b, f"{what} output {i}")


def test_mask_as_large_as_the_rows_matches_xla():
    """A (1, 1, S, S) dropout mask over (B, H, S, S) scores with B*H*S == S*S (the tiny BERT's
    attention dropout, once read as one value per row)."""
    from test_pipeline_cpu import masked_softmax

    seed = (RUN_SEED + zlib.crc32(b"mask_rows")) % (1 << 63)
    k1, k2 = jax.random.split(jax.random.key(seed))
    scores = jax.random.normal(k1, (8, 4, 32, 32)) * 3
    mask = (jax.random.uniform(k2, (1, 1, 32, 32)) < 0.9) / 0.9
    what = _msg("masked softmax", seed)
    with force_stitching():
        _, got = run_stitched(masked_softmax, (scores, mask), what)
    compare(got, jax.jit(masked_softmax)(scores, mask), what)


def one_hot_xent(logits, labels):
    """Cross-entropy with a one-hot made by `labels == iota` (the compare codegen writes per vector)."""
    one_hot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
    return jax.value_and_grad(lambda z: -jnp.mean(jnp.sum(one_hot * jax.nn.log_softmax(z), axis=-1)))(logits)


def test_one_hot_labels_at_the_edges_match_xla():
    seed = (RUN_SEED + zlib.crc32(b"one_hot_edges")) % (1 << 63)
    rng = np.random.default_rng(seed)
    n, c = 300, 5003
    labels = rng.integers(0, c, n).astype(np.int32)
    labels[:6] = [0, c - 1, -1, c, np.iinfo(np.int32).min, np.iinfo(np.int32).max]  # out of range: no class
    logits = jnp.asarray(rng.standard_normal((n, c)) * 3, jnp.float32)
    labels = jnp.asarray(labels)
    what = _msg("one_hot_xent", seed)
    want = jax.jit(one_hot_xent)(logits, labels)
    with force_stitching():
        assert jaxstitch.explain(one_hot_xent, logits, labels).stitched_kernels == 1
        _, got = run_stitched(one_hot_xent, (logits, labels), what)
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        compare(a, b, f"{what} output {i}")


def one_hot_row_losses(logits, labels):
    """Per-row cross-entropy (float32 statistics, as Flax writes it) and its gradient: a row's NaN
    stays in its own row, so NaN positions can be compared."""
    one_hot = jax.nn.one_hot(labels, logits.shape[-1], dtype=jnp.float32)
    losses, vjp = jax.vjp(lambda z: -jnp.sum(one_hot * jax.nn.log_softmax(z.astype(jnp.float32)), axis=-1),
                          logits)
    return losses, vjp(jnp.ones_like(losses))[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_hot_rows_with_non_finite_logits_match_xla(dtype):
    """Non-finite logits in the code for vectors that miss the label and in the one that holds it:
    `one_hot * x` is XLA's select, so -inf away from the label leaves the loss finite, while +inf or
    NaN (through the max) make the row NaN. bfloat16 also runs the fast exp (planner.fast_exp)."""
    seed = (RUN_SEED + zlib.crc32(f"one_hot_nonfinite{dtype}".encode())) % (1 << 63)
    rng = np.random.default_rng(seed)
    n, c = 64, 32000
    labels = rng.integers(0, c, n).astype(np.int32)
    x = rng.standard_normal((n, c)) * 3
    labels[:6] = [5, 7, 9, 11, 13, 15]
    x[0, c - 3], x[1, 100], x[2, 20000] = np.inf, -np.inf, np.nan  # away from the label
    x[3, 11], x[4, 13] = -np.inf, np.inf                           # at the label
    x[5, :] = -30.0
    x[5, 15] = 60.0                                                 # exp far from 0 both ways
    labels[6] = -1                                                  # no class
    logits, labels = jnp.asarray(x, DTYPES[dtype]), jnp.asarray(labels)
    what = _msg(f"one_hot_row_losses {dtype}", seed)
    want = jax.jit(one_hot_row_losses)(logits, labels)
    with force_stitching():
        region = jaxstitch.explain(one_hot_row_losses, logits, labels).regions[0]
        assert region.stitched and ("fast exp" in region.mapping) is (dtype == "bfloat16"), region
        _, got = run_stitched(one_hot_row_losses, (logits, labels), what)
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f"{what} output {i}: NaN positions")
        assert np.isnan(a).any(), f"{what} output {i}: the non-finite rows made no NaN"
        compare(np.asarray(got[i]), np.asarray(want[i]), f"{what} output {i}")


def forced_case(family, name, dtype, fun, draw, ops):
    """A CPU test module's case on fresh inputs (`draw(seed)`, floats in `dtype`), forced: a region
    holding one of `ops` must be stitched; its results (3 runs, bit-identical) and jax.jit's.
    Returns (what, args, got leaves, want leaves)."""
    seed = (RUN_SEED + zlib.crc32(f"{family}/{name}/{dtype}".encode())) % (1 << 63)
    args = [a if a.dtype == np.int32 else jnp.asarray(a, DTYPES[dtype]) for a in draw(seed)]
    what = _msg(f"{name} {dtype}", seed)
    with force_stitching():
        report = jaxstitch.explain(fun, *args)
        assert any(r.stitched and set(r.ops) & set(ops) for r in report.regions), str(report)
        want = jax.block_until_ready(jax.jit(fun)(*args))
        _, got = run_stitched(fun, args, what)
    return what, args, jax.tree.leaves(got), jax.tree.leaves(want)


# (the cases whose float outputs are zero exactly where a dropout mask drops)
MASKED = {"dropout", "two_dropouts"}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", sorted(PRNG_CASES))
def test_random_bits_match_xla(name, dtype):
    """Threefry bits drawn inside stitched kernels (jaxstitch/frontend/prng.py), forced, against jax.jit:
    integer outputs bit for bit, every dropout mask (where the output is zero) exactly, floats
    within the tolerance; shifts by 0..63 and bitcasts as XLA defines them."""
    fun, specs = PRNG_CASES[name]
    seed = (RUN_SEED + zlib.crc32(f"prng/{name}/{dtype}".encode())) % (1 << 63)
    args = prng_inputs(specs, seed, DTYPES[dtype])
    what = _msg(f"{name} {dtype}", seed)
    want = jax.block_until_ready(jax.jit(fun)(*args))
    with force_stitching():
        report = jaxstitch.explain(fun, *args)
        assert any(r.stitched and "shift_left" in r.ops for r in report.regions), str(report)
        _, got = run_stitched(fun, args, what)
    for i, (a, c) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        a, c = np.asarray(a), np.asarray(c)
        if name in MASKED:
            dropped = int(np.sum((a == 0) != (c == 0)))
            assert dropped == 0, f"{what} output {i}: {dropped} of {c.size} elements dropped by one mask only"
            assert 0 < np.sum(c == 0) < c.size, f"{what} output {i}: the mask drops all or nothing"
        compare(a, c, f"{what} output {i}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", sorted(VIEW_CASES))
def test_data_moving_ops_match_xla(name, dtype):
    """Slices, pads, concatenates, transposes, splits and dynamic slices inside stitched kernels
    (plan/views.py), forced, against jax.jit: the cases the CPU tests check the rewrite on."""
    fun, specs = VIEW_CASES[name]
    what, _, got, want = forced_case("views", name, dtype, fun, lambda s: view_inputs(specs, s), VIEWS)
    for i, (a, c) in enumerate(zip(got, want)):
        compare(a, c, f"{what} output {i}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", sorted(PAIR_CASES))
def test_paired_halves_match_xla(name, dtype):
    """Rotary embeddings whose other half is read from the registers of a paired mapping
    (plan/pairs.py), forced, against jax.jit; the plan must be paired (else this tests nothing new)."""
    fun, specs = PAIR_CASES[name]
    what, args, got, want = forced_case("pairs", name, dtype, fun, lambda s: view_inputs(specs, s), VIEWS)
    with force_stitching():
        report = jaxstitch.explain(fun, *args)
    assert any(r.stitched and "paired" in (r.mapping or "") for r in report.regions), str(report)
    for i, (a, c) in enumerate(zip(got, want)):
        compare(a, c, f"{what} output {i}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", sorted(SPREAD_CASES))
def test_inputs_spread_over_rows_match_xla(name, dtype):
    """Inputs broadcast over only some row axes (an attention dropout mask), read through stride-0
    views, forced, against jax.jit."""
    fun, specs = SPREAD_CASES[name]
    what, _, got, want = forced_case("spread", name, dtype, fun, lambda s: view_inputs(specs, s), {"mul"})
    for i, (a, c) in enumerate(zip(got, want)):
        compare(a, c, f"{what} output {i}")


RECOMPUTE_CASES = {"norm_across_a_dot": (norm_across_a_dot, RECOMPUTE_SPECS),
                   "residual_norm_across_a_dot": (residual_norm_across_a_dot, RESIDUAL_SPECS),
                   "shared_leaf_across_a_dot": (shared_leaf_across_a_dot, SHARED_SPECS),
                   "halves_across_a_dot": (halves_across_a_dot, SLICED_SPECS)}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", sorted(RECOMPUTE_CASES))
def test_recomputed_chains_match_xla(name, dtype):
    """A region after a matrix product that takes in `f32(x) - mean` (and `2 * x`, or the slices of
    a wider value: recompute.py) rather than read it, its producer writing x instead (or nothing),
    forced, against jax.jit; then the same with that region left to XLA, which rebuilds the values
    the stitched producer no longer writes."""
    fun, specs = RECOMPUTE_CASES[name]
    # (the product in float32 on both sides, not TF32, whose input rounding a last-bit difference
    # flips; a float32 output computed from the product's half-precision result is held to that
    # dtype's tolerance)
    with jax.default_matmul_precision("float32"):
        what, args, got, want = forced_case("recompute", name, dtype, fun, lambda s: view_inputs(specs, s),
                                            {"sub", "slice"})
        with readers_left_to_xla():
            _, declined = run_stitched(fun, args, what + " (reader left to XLA)")
    for i, (a, c) in enumerate(zip(got, want)):
        compare(a, c, f"{what} output {i}", lossy=dtype)
    for i, (a, c) in enumerate(zip(jax.tree.leaves(declined), want)):
        compare(a, c, f"{what} output {i} (reader left to XLA)", lossy=dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_merged_products_match_xla(monkeypatch, dtype):
    """A SwiGLU MLP's gradients, its products merged over concatenations in bfloat16
    (merged_products.py, JAXSTITCH_TUNE=merge_products=1; in float32 the weights are read as they
    are and nothing merges), forced and as planned, against jax.jit."""
    f32 = jnp.float32
    specs = [jax.ShapeDtypeStruct((1031, 256), DTYPES[dtype]), jax.ShapeDtypeStruct((256, 512), f32),
             jax.ShapeDtypeStruct((256, 512), f32), jax.ShapeDtypeStruct((512, 256), f32)]
    seed = (RUN_SEED + zlib.crc32(f"merged/{dtype}".encode())) % (1 << 63)
    args = random_inputs(specs, seed)
    what = _msg(f"swiglu_grads {dtype}", seed)
    monkeypatch.setenv("JAXSTITCH_TUNE", "merge_products=1")
    assert ("matrix products merged" in str(jaxstitch.explain(swiglu_grads, *args))) == (dtype == "bfloat16")
    # (the products in float32 on both sides, not TF32, whose input rounding a last-bit difference flips)
    with jax.default_matmul_precision("float32"):
        want = jax.tree.leaves(jax.block_until_ready(jax.jit(swiglu_grads)(*args)))
        with force_stitching():
            _, forced = run_stitched(swiglu_grads, args, what + " (forced)")
        _, planned = run_stitched(swiglu_grads, args, what)
    for label, got in (("forced", forced), ("planned", planned)):
        for i, (a, c) in enumerate(zip(jax.tree.leaves(got), want)):
            compare(a, c, f"{what} output {i} ({label})", lossy=dtype)


FOLD_CASES = {  # name -> (function, specs(dtype), JAXSTITCH_TUNE)
    "rotary_every_fold": (rotary_attention_grads, lambda dt: rotary_specs(dt, 3, 72, 3 * 40),
                          "batched_folds=2,product_concats=1"),
    "bias_default": (bias_attention_grads, lambda dt: bias_specs(dt, 3, 72, 3 * 40), ""),
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", sorted(FOLD_CASES))
def test_batched_folds_match_xla(monkeypatch, case, dtype):
    """Attention blocks' gradients with their batched products' transposes folded
    (batched_products.py): GPT's with every fold and the rotary backward's concatenation ours
    (JAXSTITCH_TUNE=batched_folds=2,product_concats=1), BERT-like q/k/v biases' with the default
    folds; forced and as planned, against jax.jit."""
    fn, make_specs, tune = FOLD_CASES[case]
    seed = (RUN_SEED + zlib.crc32(f"batched/{case}/{dtype}".encode())) % (1 << 63)
    args = random_inputs(make_specs(DTYPES[dtype]), seed)
    what = _msg(f"{fn.__name__} {dtype}", seed)
    monkeypatch.setenv("JAXSTITCH_TUNE", tune)
    assert "batched products reordered" in str(jaxstitch.explain(fn, *args))
    with jax.default_matmul_precision("float32"):
        want = jax.tree.leaves(jax.block_until_ready(jax.jit(fn)(*args)))
        with force_stitching():
            _, forced = run_stitched(fn, args, what + " (forced)")
        _, planned = run_stitched(fn, args, what)
        # (in bfloat16 against float32, with jax.jit's own distance from it as slack: the stitched
        # kernels round dq, dk and dv at other points than XLA's fusions, and the weight gradient
        # sums 216 of them; the tolerance alone is what a single rounding moves)
        wide = [a.astype(jnp.float32) for a in args]
        exact = jax.tree.leaves(jax.block_until_ready(jax.jit(fn)(*wide)))
    for label, got in (("forced", forced), ("planned", planned)):
        for i, (a, c, r) in enumerate(zip(jax.tree.leaves(got), want, exact)):
            if dtype == "float32":
                compare(a, c, f"{what} output {i} ({label})")
                continue
            xla_off = float(np.max(np.abs(np.asarray(c, np.float32) - np.asarray(r, np.float32)), initial=0.0))
            compare(a, np.asarray(r).astype(np.asarray(a).dtype), f"{what} output {i} ({label}) against float32",
                    slack=xla_off)

@pytest.mark.parametrize("draw", range(3))
def test_attention_gradients_keep_their_identities(draw):
    """An attention block's bfloat16 gradients (q/k/v projection with biases; the key bias's is
    exactly 0) are no further from float32 than jax.jit's: within 1.5x its distance. Formerly
    they were 1.5-5x further on every one of 25 seeds (the softmax forward subtracted
    its row max unrounded but wrote it rounded for the backward, which recomputed the exponentials
    from it: cuda_ops.written_half), and now 1.1-5x nearer (H100, 6 seeds)."""
    seed = (RUN_SEED + zlib.crc32(f"identities/{draw}".encode())) % (1 << 63)
    args = random_inputs(bias_specs(jnp.bfloat16, 3, 72, 3 * 40), seed)
    what = _msg("bias_attention_grads bfloat16", seed)
    with jax.default_matmul_precision("float32"):
        exact = jax.tree.leaves(jax.jit(bias_attention_grads)(*[a.astype(jnp.float32) for a in args]))
        xla = jax.tree.leaves(jax.jit(bias_attention_grads)(*args))
        with force_stitching():  # (regions this small are launch-bound: planned, XLA keeps them)
            _, ours = run_stitched(bias_attention_grads, args, what)
    for i, (o, x, e) in enumerate(zip(jax.tree.leaves(ours), xla, exact)):
        e32 = np.asarray(e, np.float32)
        ours_off, xla_off = (float(np.max(np.abs(np.asarray(a, np.float32) - e32))) for a in (o, x))
        bound = 1.5 * xla_off + TOL["float32"] * float(np.max(np.abs(e32)))
        assert ours_off <= bound, f"{what} output {i}: {ours_off:.3g} from float32, jax.jit {xla_off:.3g}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_remote_updates_of_half_state_match_xla(dtype):
    """Momentum updates of half-precision leaves in one remote kernel, whose parameter updates read
    the new momentum rounded, as written (test_roundings.py checks the source), against jax.jit."""
    specs = momentum_specs(jnp.dtype(dtype))
    seed = (RUN_SEED + zlib.crc32(f"momentum/{dtype}".encode())) % (1 << 63)
    args = random_inputs(specs, seed)
    what = _msg(f"momentum_steps {dtype}", seed)
    want = jax.block_until_ready(jax.jit(momentum_steps)(*args))
    _, got = run_stitched(momentum_steps, args, what)
    assert [r.scheme for r in jaxstitch.explain(momentum_steps, *args).regions if r.stitched] == ["remote"]
    for i, (a, b) in enumerate(zip(got, want)):
        compare(a, b, f"{what} output {i}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_attention_forward_writing_only_probabilities_matches_xla(dtype):
    """GPT's attention and its gradients as planned: the forward writes the probabilities alone and
    the backward recomputes the masked exponentials from the scores the product wrote (recompute.py),
    against jax.jit."""
    specs = [jax.ShapeDtypeStruct(s.shape, DTYPES[dtype]) for s in ATTENTION_SPECS]
    seed = (RUN_SEED + zlib.crc32(f"gpt_attention/{dtype}".encode())) % (1 << 63)
    args = random_inputs(specs, seed)
    what = _msg(f"gpt_attention_grads {dtype}", seed)
    # (products in float32 on both sides, as in test_masks_from_positions_match_xla)
    with jax.default_matmul_precision("float32"):
        want = jax.block_until_ready(jax.jit(gpt_attention_grads)(*args))
        _, got = run_stitched(gpt_attention_grads, args, what)
        report = jaxstitch.explain(gpt_attention_grads, *args)
    stitched = [r for r in report.regions if r.stitched]
    assert len(stitched) == 2 and "reduce_max" in stitched[0].ops, str(report)
    for i, (a, b) in enumerate(zip(got, want)):
        compare(a, b, f"{what} output {i}")


PREFIX_CASES = {"causal": (masked_softmax, (2, 3, 200, 200)),
                "strict": (functools.partial(masked_softmax, strict=True), (2, 3, 200, 200)),
                "window": (functools.partial(masked_softmax, window=24), (2, 3, 200, 200)),
                "q_outer": (functools.partial(masked_softmax, q_axis=1), (2, 200, 3, 200))}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", sorted(PREFIX_CASES))
def test_prefix_copies_match_xla(name, dtype):
    """Softmaxes under causal masks whose stage copies skip each row's columns past the mask
    (plan/prefixes.py: zeros staged instead), forced, against jax.jit."""
    fun, shape = PREFIX_CASES[name]
    specs = [jax.ShapeDtypeStruct(shape, DTYPES[dtype])]
    seed = (RUN_SEED + zlib.crc32(f"prefix/{name}/{dtype}".encode())) % (1 << 63)
    args = random_inputs(specs, seed)
    what = _msg(f"prefix {name} {dtype}", seed)
    tree = jax.tree_util.tree_structure((tuple(specs), {}))
    with force_stitching():
        program = jaxstitch.driver.pipeline.build(fun, list(specs), tree, jaxstitch.targets.detect(),
                                                  jaxstitch.core.config.load())
        assert any(c.stitched and c.plan.kernel.prefixes for c in program.regions), what
        _, got = run_stitched(fun, args, what)
    compare(got, jax.block_until_ready(jax.jit(fun)(*args)), what)


MASK_CASES = dict(POSITIONAL_CASES, attention_grad=(causal_attention_grad, (jax.ShapeDtypeStruct((3, 5, 72, 72), jnp.float32),
                                                                          jax.ShapeDtypeStruct((3, 5, 72, 40), jnp.float32))),
                  softmax_bwd_from_probs=(causal_softmax_bwd, (jax.ShapeDtypeStruct((3, 5, 72, 72), jnp.float32),) * 2))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", sorted(MASK_CASES))
def test_masks_from_positions_match_xla(name, dtype):
    """Causal and sliding-window masks rebuilt at the scores' shape (graph/positions.py), forward and
    (through attention's gradient) backward, forced, against jax.jit."""
    fun, specs = MASK_CASES[name]
    # (attention's products in float32 on both sides: at the default TF32 a last-bit difference of
    # the stitched softmax flips an input's TF32 rounding, 1e-4 of the gradient apart once in a while)
    with jax.default_matmul_precision("float32"):
        what, args, got, want = forced_case("positions", name, dtype, fun, lambda s: view_inputs(specs, s),
                                            {"exp", "mul"})
    # (in bfloat16 jax.jit rounds every op of the chain, attention's products included: both are
    # held to the float32 result of the same inputs, ours no further from it than jax.jit's)
    exact = jax.tree.leaves(jax.jit(fun)(*[a.astype(jnp.float32) for a in args])) if dtype == "bfloat16" else None
    for i, (a, c) in enumerate(zip(got, want)):
        if exact is None:
            compare(a, c, f"{what} output {i}")
            continue
        e = np.asarray(exact[i])
        ours, theirs = (float(np.max(np.abs(np.asarray(x, np.float32) - e))) for x in (a, c))
        assert ours <= theirs + 2 ** -8 * float(np.max(np.abs(e))), f"{what} output {i}: {ours} vs jax.jit's {theirs}"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", sorted(SCAN_CASES))
def test_scans_match_xla(name, dtype):
    """Cumulative sums, products, maxima and minima along rows, both ways, in every mapping (lanes of a
    warp, warps through shared memory, chunks with a carry), forced, against jax.jit."""
    fun, specs, _ = SCAN_CASES[name]
    what, args, got, want = forced_case("scans", name, dtype, fun, lambda s: random_inputs(specs, s), SCANS)
    rows = _decided_rows("top_p_filter", args, got[0], want[0]) if name.startswith("top_p") else None
    exact = HALF_SCANS.get(name) if (dtype == "bfloat16" or name.startswith("bf16")) else None
    for i, (a, c) in enumerate(zip(got, want)):
        if rows is not None:
            a, c = np.asarray(a)[rows], np.asarray(c)[rows]
        if exact is not None:  # XLA's own sums are bfloat16 values: ours against the exact fold
            ref = exact(args[0])
            xla_err = float(np.max(np.abs(np.asarray(c, np.float64) - ref)))
            compare(np.asarray(a, np.float32), ref.astype(np.float32), f"{what} output {i} "
                    f"(against float64; XLA's error {xla_err:.3g})", lossy=np.dtype(a.dtype).name)
            continue
        compare(a, c, f"{what} output {i}")


# Scans that XLA folds in bfloat16 (its partial sums are bfloat16 values; its error went past the
# bfloat16 tolerance against ours on an H100), where ours fold in float32: compared with the fold in
# float64 of the same terms (a term an explicit
# convert rounds to bfloat16 is rounded; other intermediates keep their precision, as XLA's excess
# precision lets both compilers do).
HALF_SCANS = {
    "bf16_cumsum": lambda x: np.cumsum(np.asarray(jnp.asarray(x).astype(jnp.bfloat16), np.float64), -1),
    "growth": lambda x: np.cumprod(1.0 + 0.01 * np.asarray(x, np.float64), 1),
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", sorted(VARIADIC_CASES))
def test_variadic_reduces_match_xla(name, dtype):
    """Variadic reduces under the user's combiner (argmax/argmin with the value, ties among coarse
    values; a max with its count; the first index where a mask holds; two sums; the MoE router) in
    every mapping (rows per warp, warps through shared memory, chunks), forced, against jax.jit.
    Picked indices must agree exactly."""
    fun, specs, _ = VARIADIC_CASES[name]
    what, _, got, want = forced_case("variadic", name, dtype, fun, lambda s: random_inputs(specs, s),
                                     {VARIADIC})
    for i, (a, c) in enumerate(zip(got, want)):
        compare(a, c, f"{what} output {i}")


@pytest.mark.parametrize("teams", [1, 4])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", sorted(TRANSPOSE_CASES))
def test_transposed_tiles_match_xla(name, dtype, teams, monkeypatch):
    """Transposes of the minor axis in batches of small tiles (inputs read transposed from shared or
    global memory, outputs stored transposed), reshapes merging or splitting a tile's two axes,
    forced, against jax.jit; a block or a warp on each tile."""
    monkeypatch.setenv("JAXSTITCH_TUNE", f"teams={teams}")
    fun, specs = TRANSPOSE_CASES[name]
    what, _, got, want = forced_case("transpose", name, dtype, fun, lambda s: random_inputs(specs, s),
                                     {"transpose", "reshape"})
    for i, (a, c) in enumerate(zip(got, want)):
        compare(a, c, f"{what} output {i}")


# ---------------------------------------------------------------------------------------------------
# transformations and control flow (the CPU tests in test_transforms.py, on our kernels)
# ---------------------------------------------------------------------------------------------------

GPU_COMPOSITIONS = ("grad", "jit_of_grad", "value_and_grad_in_jit", "vmap", "linearize", "checkpoint_grad")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("comp", GPU_COMPOSITIONS)
@pytest.mark.parametrize("name", sorted(FUNS))
def test_transforms_match_xla(name, comp, dtype):
    """jax.grad / vmap / linearize / checkpoint of jaxstitch.jit, and jaxstitch.jit of jax.grad, forced:
    the transformed regions run as our kernels (at least MIN_KERNELS of them) and match jax.jit of the
    same composition of the plain function."""
    f, specs = FUNS[name]
    seed = (RUN_SEED + zlib.crc32(f"transforms/{name}/{comp}/{dtype}".encode())) % (1 << 63)
    args = [a if a.dtype == np.int32 else jnp.asarray(a, DTYPES[dtype]) for a in random_inputs(specs, seed)]
    what = _msg(f"{comp}({name}) {dtype}", seed)
    make = COMPOSITIONS[comp]
    with force_stitching():
        fn = make(jaxstitch.jit, f, args)
        kernels = stitched_kernels(jax.make_jaxpr(fn)())
        outs = [jax.block_until_ready(fn()) for _ in range(RUNS)]
    assert kernels >= MIN_KERNELS.get(comp, 1), f"{what}: {kernels} stitched kernels"
    _same_bits(outs, what)
    want = jax.block_until_ready(jax.jit(make(lambda g: g, f, args))())
    for i, (a, c) in enumerate(zip(jax.tree.leaves(outs[0]), jax.tree.leaves(want), strict=True)):
        if np.asarray(c).dtype != jax.dtypes.float0:  # (float32 losses of bfloat16 results: lossy)
            compare(a, c, f"{what} output {i}", lossy=dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", sorted(CONTROL_FLOW))
def test_control_flow_bodies_match_xla(name, dtype):
    """Stitched regions inside while / fori / cond bodies, and scans (with a scan's backward pass)
    as persistent kernels (plan/scan.py) or with stitched bodies.
    The GRU cell's matrix products run in full float32: with TF32 (XLA's default), a last-bit
    difference in a product's input (ours and XLA's elementwise code round differently) moved the
    float32 gradient of the recurrent weights by 2e-4 of its scale over 10 steps.
    In bfloat16 a gradient carried through the scan is rounded to bfloat16 at every step, by XLA and
    by us at different points (4 ulps apart after 10 steps on an H200): there each output is held to
    the float32 result within twice XLA's own distance from it (or the bfloat16 tolerance)."""
    f, specs, _ = CONTROL_FLOW[name]
    with jax.default_matmul_precision("float32"):
        what, args, got, want = forced_case("control_flow", name, dtype, f, lambda s: random_inputs(specs, s),
                                            ELEMENTWISE | {"scan"})
        exact = jax.tree.leaves(jax.jit(f)(*[a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a
                                             for a in args]))
    for i, (a, c, e) in enumerate(zip(got, want, exact)):
        if dtype == "float32" or not jnp.issubdtype(np.asarray(c).dtype, jnp.floating):
            compare(a, c, f"{what} output {i}")
            continue
        a32, c32, e32 = (np.asarray(v, np.float32) for v in (a, c, e))
        ours, xla = float(np.max(np.abs(a32 - e32))), float(np.max(np.abs(c32 - e32)))
        bound = max(2 * xla, TOL["bfloat16"] * float(np.max(np.abs(e32))))
        assert ours <= bound, f"{what} output {i}: {ours:.3g} from float32, XLA {xla:.3g} (bound {bound:.3g})"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_embedding_gradients_match_the_exact_sum(dtype):
    """An embedding's gradient through a half-precision lookup, then an Adam-like update of the
    table, with a fifth of the ids one [MASK] id (wide_scatter.py: XLA scatters in float32, rounds
    once): against the exact sum (float64) and jax.jit of the same float32 formulation. Not checked
    for the same bits run to run: XLA's float32 atomics add in any order, as its half-precision
    ones do under jax.jit."""
    def step(table, ids, dy, m):
        g = embedding_grad(table, ids, dy)
        m = 0.9 * m + 0.1 * g
        return table - 1e-3 * m, m, g

    def want_step(table, ids, dy, m):
        g = widened(table, ids, dy)
        m = 0.9 * m + 0.1 * g
        return table - 1e-3 * m, m, g

    seed = (RUN_SEED + zlib.crc32(f"embedding/{dtype}".encode())) % (1 << 63)
    rng = np.random.default_rng(seed)
    vocab, hidden, dt = 30522, 768, jnp.dtype(dtype)
    ids = rng.integers(1000, vocab, (32, 128))
    ids[:, rng.permutation(128)[:20]] = 103
    table = jnp.asarray(rng.standard_normal((vocab, hidden)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((32, 128, hidden)), dt)
    m = jnp.asarray(rng.standard_normal((vocab, hidden)), jnp.float32)
    args = (table, jnp.asarray(ids, jnp.int32), dy, m)
    what = _msg(f"embedding gradient {dtype}", seed)
    report = jaxstitch.explain(step, *args)
    assert dict(report.rewritten).get("scatter-add in float32") == 1, str(report)
    got = jax.block_until_ready(jaxstitch.jit(step)(*args))
    want = jax.block_until_ready(jax.jit(want_step)(*args))
    for i, (a, c) in enumerate(zip(got, want)):
        compare(a, c, f"{what} output {i}")
    exact = np.zeros((vocab, hidden))
    np.add.at(exact, ids.reshape(-1), np.asarray(dy.astype(jnp.float32), np.float64).reshape(-1, hidden))
    err = np.abs(np.asarray(got[2], np.float64) - exact).max(-1) / np.maximum(np.abs(exact).max(-1), 1e-30)
    assert err.max() <= 2.0 ** -7, f"{what}: gradient off the exact sum by {err.max():.3g} of its row (row {err.argmax()})"
