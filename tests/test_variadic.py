"""Variadic reductions (`lax.reduce` over several operands under the user's combiner: argmax or
argmin with the value, a max with its count, the first index where a mask holds) inside stitched
regions: which regions hold them, the mappings that carry them, the reasons when they are left to
XLA, and that every kernel NVRTC compiles. The GPU test of the same cases is in
test_gpu_correctness.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxstitch
from strategies import assert_same_as_jax_jit, random_inputs
from jaxstitch.core import ops as opdefs
from jaxstitch.bench.workloads import moe_router, top1_pair

INT_MAX = int(np.iinfo(np.int32).max)
WEIGHTS = np.array([2.0, 3.0], np.float32)


def f32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _index(x):
    return lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)


# Computed values that a pick compares are float32: bfloat16 ones may be kept in excess precision by
# either compiler (XLA's default), and a pick is exact where a sum has a tolerance. And they are
# correctly rounded (abs, a subtraction): XLA's tanh and CUDA's tanhf approximate differently, and
# two values 1.1 ulp apart swapped places in one row of 300 (seed 3728217788506450558).
def argmax_with_value(x):
    v, i = lax.reduce((jnp.abs(x.astype(jnp.float32)) - 1.0, _index(x)), (-jnp.inf, 0), top1_pair, (x.ndim - 1,))
    return v * 2.0, i


def _bottom1(a, b):
    (av, ai), (bv, bi) = a, b
    take = (bv < av) | ((bv == av) & (bi < ai))
    return jnp.where(take, bv, av), jnp.where(take, bi, ai)


def argmin_with_value(x):  # of coarse values (many ties: the smallest index wins; exact in bfloat16)
    v, i = lax.reduce((jnp.round(x * 2.0), _index(x)), (jnp.array(jnp.inf, x.dtype), INT_MAX), _bottom1,
                      (x.ndim - 1,))
    return v, i


def _max_count(a, b):
    (av, ac), (bv, bc) = a, b
    m = jnp.maximum(av, bv)
    return m, jnp.where(av == m, ac, 0) + jnp.where(bv == m, bc, 0)


def max_with_count(x):  # how often each row's max occurs, of integer values
    q = jnp.floor(x.astype(jnp.float32) * 1.5).astype(jnp.int32)
    return lax.reduce((q, jnp.ones_like(q)), (jnp.int32(np.iinfo(np.int32).min), 0), _max_count, (x.ndim - 1,))


def _first_true(a, b):
    (am, ai), (bm, bi) = a, b
    take = (bm & ~am) | ((bm == am) & (bi < ai))
    return jnp.where(take, bm, am), jnp.where(take, bi, ai)


def first_above(x):  # the first column where x > 1 (INT_MAX if none), as a stopping criterion
    hit, i = lax.reduce((x > 1.0, _index(x)), (False, INT_MAX), _first_true, (x.ndim - 1,))
    return hit, i


def sum_and_sumsq(x):  # two sums in one reduce, then a variance
    x = x.astype(jnp.float32)
    s, q = lax.reduce((x, x * x), (0.0, 0.0), lambda a, b: (a[0] + b[0], a[1] + b[1]), (x.ndim - 1,))
    n = x.shape[-1]
    return q / n - (s / n) ** 2


CASES = {  # name: (function, input specs, what the mapping must say or None)
    "argmax_with_value": (argmax_with_value, (f32(300, 1000),), "warps per row"),
    "argmax_with_value_chunked": (argmax_with_value, (f32(40, 32000),), "chunks"),
    "argmin_with_value_short": (argmin_with_value, (f32(4096, 24),), "rows per warp"),
    "max_with_count": (max_with_count, (f32(500, 300),), None),
    "first_above": (first_above, (f32(8, 16, 128),), None),
    "sum_and_sumsq": (sum_and_sumsq, (f32(1000, 200),), None),
    "moe_router": (moe_router, (f32(4096, 64),), "rows per warp"),
    "moe_router_wide": (moe_router, (f32(257, 2048),), "block per row"),
}


def _reducing(report):
    return [r for r in report.regions if opdefs.VARIADIC in r.ops]


@pytest.mark.parametrize("name", sorted(CASES))
def test_variadic_reduce_stitches_into_one_kernel_and_compiles(name, monkeypatch):
    """Forced (any estimated gain): the reduce's region is one kernel, NVRTC compiles it."""
    monkeypatch.setenv("JAXSTITCH_TUNE", "min_gain_pct=0")
    fun, specs, mapping = CASES[name]
    report = jaxstitch.explain(fun, *specs, target="h100")
    reducing = _reducing(report)
    assert len(reducing) == 1 and reducing[0].stitched and reducing[0].kernels == 1, report
    if mapping:
        assert mapping in reducing[0].mapping, report


def test_moe_router_is_one_kernel_unforced():
    report = jaxstitch.explain(moe_router, f32(1 << 20, 64), target="h100")
    reducing = _reducing(report)
    assert reducing and reducing[0].stitched and reducing[0].kernels == 1, report


def test_kernel_folds_lane_pairs_lower_lane_first(tmp_path, monkeypatch):
    """Partners of a shuffle combine in lane order, so a combiner that is not commutative still leaves
    every lane of a row with the same partials."""
    monkeypatch.setenv("JAXSTITCH_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("JAXSTITCH_TUNE", "min_gain_pct=0")
    jaxstitch.explain(argmax_with_value, f32(300, 1000), target="h100")
    code = "\n".join(p.read_text() for p in tmp_path.rglob("*.cu"))
    assert "if (lane & o) {" in code and "__device__ __forceinline__ void js_comb" in code


def test_a_variadic_reduce_is_not_split_over_blocks():
    report = jaxstitch.explain(argmax_with_value, f32(8, 262144), target="h100")
    assert "split" not in (_reducing(report)[0].mapping or ""), report


@pytest.mark.parametrize("fun,specs,reason", [
    (lambda x, s: lax.reduce(x, s, lambda a, b: a * b + 1.0, (1,)), (f32(64, 32), f32()),
     "initial values computed at run time"),
    (lambda x: lax.reduce((jnp.exp(x), _index(x)), (-jnp.inf, 0), top1_pair, (0,)), (f32(64, 32),),
     "stitched only along the last axes"),
    (lambda x: lax.reduce(jnp.exp(x), 1.0, lambda a, b: lax.nextafter(a, b), (1,)), (f32(64, 32),),
     "combiner uses nextafter"),
    (lambda x: lax.reduce(x, 0.0, lambda a, b: a + b * jnp.asarray(WEIGHTS)[1], (1,)), (f32(64, 32),),
     "combiner captures constants"),
])
def test_unstitchable_variadic_reduces_say_why(fun, specs, reason):
    report = jaxstitch.explain(fun, *specs, target="h100")
    assert reason in str(report), report


@pytest.mark.parametrize("name", ["argmax_with_value", "max_with_count", "first_above", "moe_router"])
def test_fallback_matches_jax_jit(name, gpu_available):
    """Without a GPU, jaxstitch.jit runs jax.jit's program: bit for bit. (On a GPU the stitched
    kernels sum in their own order, moe_router's softmax total 1 ulp off in 29% of rows:
    test_variadic_reduces_match_xla compares those with tolerances.)"""
    if gpu_available:
        pytest.skip("a GPU is present: the regions are stitched (compared in test_variadic_reduces_match_xla)")
    fun, specs, _ = CASES[name]
    assert_same_as_jax_jit(fun, random_inputs(specs, 5))
