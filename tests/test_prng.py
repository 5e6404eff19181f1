"""Dropout's random bits inside regions (jaxstitch/frontend/prng.py), on the CPU: the written-out threefry
draws jax.random's bits exactly, it is used only where that is known, and regions holding it, its
uint32 ops, shifts and bitcasts plan and compile. The GPU test (test_gpu_correctness) runs CASES."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxstitch
from jaxstitch.core import ir, ops as opdefs
from jaxstitch.frontend import prng, trace as trace_mod
from jaxstitch.kernels import nvrtc
from jaxstitch.bench.workloads import WORKLOADS

needs_nvrtc = pytest.mark.skipif(not nvrtc.available(), reason="NVRTC is not installed")
S = jax.ShapeDtypeStruct
U32 = jnp.uint32


def dropout(x, raw_key, rate=0.1):
    keep = jax.random.bernoulli(jax.random.wrap_key_data(raw_key), 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


def dropout_residual_layernorm(x, h, raw_key):
    """A transformer's post-attention block: dropout, residual, layer norm (a row reduction region)."""
    y = x.astype(jnp.float32) + dropout(h, raw_key).astype(jnp.float32)
    m = jnp.mean(y, -1, keepdims=True)
    v = jnp.mean(jnp.square(y - m), -1, keepdims=True)
    return ((y - m) * lax.rsqrt(v + 1e-5)).astype(x.dtype)


def two_dropouts(x, raw_key):
    """Two independent masks from one key (split: two keys computed by XLA), summed."""
    k1, k2 = jax.random.split(jax.random.wrap_key_data(raw_key))
    a = jax.random.bernoulli(k1, 0.5, x.shape)
    b = jax.random.bernoulli(k2, 0.8, x.shape)
    return jnp.where(a, x, 0.0) + jnp.where(b, 2 * x, 0.0)


def bits_and_uniform_mean(x, raw_key):
    """The bits themselves as an output (exact), and a row mean of uniforms made from them."""
    key = jax.random.wrap_key_data(raw_key)
    bits = jax.random.bits(key, x.shape, U32)
    u = jax.random.uniform(key, x.shape)
    return bits, jnp.mean(u * x.astype(jnp.float32), -1)


def shifts_and_bitcasts(x):
    """XLA's shift semantics for every amount 0..63 (32 and more: 0, or the sign) and bitcasts."""
    a = lax.bitcast_convert_type(x.astype(jnp.float32), U32)
    s = lax.shift_right_logical(a, U32(26))  # 0..63
    i = lax.bitcast_convert_type(a, jnp.int32)
    si = lax.bitcast_convert_type(s, jnp.int32)
    back = lax.bitcast_convert_type((a ^ U32(1)) | lax.shift_left(s, U32(3)), jnp.float32)
    return (lax.shift_left(a, s), lax.shift_right_logical(a, s), lax.shift_right_arithmetic(i, si),
            lax.shift_left(i, si), ~a + s * U32(3), back * 2.0)


# name -> (function, input specs: a float array's shape, or "key" for a raw uint32[2] key)
CASES = {
    "dropout": (dropout, [(67, 300), "key"]),
    "dropout_residual_layernorm": (dropout_residual_layernorm, [(129, 768), (129, 768), "key"]),
    "two_dropouts": (two_dropouts, [(33, 1000), "key"]),
    "bits_and_uniform_mean": (bits_and_uniform_mean, [(20, 513), "key"]),
    "shifts_and_bitcasts": (shifts_and_bitcasts, [(40, 256)]),
}


def case_inputs(specs, seed, dtype=jnp.float32):
    """Fresh random inputs: normal floats in `dtype`, raw keys of random bits."""
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.integers(0, 2 ** 32, 2, dtype=np.uint64).astype(np.uint32)) if s == "key"
            else jnp.asarray(rng.standard_normal(s) * 3, dtype) for s in specs]


def case_specs(specs, dtype=jnp.float32):
    return [S((2,), U32) if s == "key" else S(s, dtype) for s in specs]


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (2, 3, 4), (1, 1), (5, 1, 9), (1000, 33)])
@pytest.mark.parametrize("seed", [0, 1, 2 ** 31 + 5])
def test_bits_match_jax_random(shape, seed):
    key = jax.random.key(seed)
    want = jax.random.bits(key, shape, U32)
    got = jax.jit(prng.bits, static_argnums=1)(jax.random.key_data(key), shape)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _prims(fun, *specs):
    graph = trace_mod.trace(fun, specs, trace_mod.positional_tree(specs)).graph
    return {op.prim for op in graph.ops}


def test_random_bits_are_written_out_where_the_bits_are_known():
    prims = _prims(dropout, S((8, 16), jnp.float32), S((2,), U32))
    assert "random_bits" not in prims and {"shift_left", "xor", "iota"} <= prims, prims


@pytest.mark.parametrize("why,fun,specs", [
    ("16-bit words", lambda k: jax.random.bits(jax.random.wrap_key_data(k), (4, 8), jnp.uint16), [S((2,), U32)]),
    ("a batch of keys", lambda k: jax.vmap(lambda kk: jax.random.bits(kk, (8,)))(
        jax.random.split(jax.random.wrap_key_data(k), 3)), [S((2,), U32)]),
    ("another impl", lambda x: jax.random.bits(jax.random.key(0, impl="rbg"), (4, 8)) + x, [S((4, 8), U32)]),
])
def test_random_bits_stay_opaque_otherwise(why, fun, specs):
    assert "random_bits" in _prims(fun, *specs), why


def test_random_bits_stay_opaque_without_partitionable_threefry():
    before = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", False)
    try:
        assert "random_bits" in _prims(dropout, S((8, 16), jnp.float32), S((2,), U32))
    finally:
        jax.config.update("jax_threefry_partitionable", before)


@pytest.mark.parametrize("name", sorted(CASES))
def test_fallback_matches_jax_jit_bit_for_bit(name, gpu_available):
    if gpu_available:
        pytest.skip("stitched on a GPU: test_gpu_correctness compares those")
    fun, specs = CASES[name]
    args = case_inputs(specs, 11)
    got, want = jaxstitch.jit(fun)(*args), jax.jit(fun)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@needs_nvrtc
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_cases_plan_and_compile(name, dtype, monkeypatch):
    """Forced (any estimated gain): the region with the integer ops is one stitched kernel, and NVRTC
    compiles it."""
    monkeypatch.setenv("JAXSTITCH_TUNE", "min_gain_pct=0")
    fun, specs = CASES[name]
    report = jaxstitch.explain(fun, *case_specs(specs, dtype), target="h100")
    for r in report.regions:
        assert not r.reason or not r.reason.startswith(("codegen", "NVRTC")), r.reason
    assert any(r.stitched and {"shift_left", "shift_right_logical"} & set(r.ops) for r in report.regions), report
    assert "random_bits" not in {p for p, _ in report.xla_ops}, report


@needs_nvrtc
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bias_gelu_dropout_draws_its_bits_in_one_kernel(dtype):
    """At a size where the integer ops bound both sides, the cost model stitches GELU and dropout
    with the bits (XLA's fusion issues fewer integer ops per microsecond: the target's calibration.xla_int_ops_per_sm_us)."""
    x, b = S((8192, 2048), dtype), S((2048,), dtype)
    report = jaxstitch.explain(WORKLOADS["bias_gelu_dropout"].fn, x, b, S((2,), U32), target="h100")
    (region,) = [r for r in report.regions if "erfc" in r.ops]
    assert region.stitched and region.kernels == 1 and "shift_left" in region.ops, report
    assert region.est_us < region.xla_est_us, report
    assert {p for p, _ in report.xla_ops} <= {"random_wrap", "random_unwrap"}, report


def test_a_small_dropout_is_left_to_xla_with_the_estimate():
    """A million elements: the launch weighs on the estimated gain, below cost.MIN_GAIN."""
    x, b = S((1024, 1024), jnp.float32), S((1024,), jnp.float32)
    report = jaxstitch.explain(WORKLOADS["bias_gelu_dropout"].fn, x, b, S((2,), U32), target="h100")
    (region,) = [r for r in report.regions if "erfc" in r.ops]
    assert not region.stitched and "one kernel" in region.reason and "predicted" in region.reason, report


def _op(prim, ins, out, **params):
    vals = [ir.Value(i, (8, 8), d) for i, d in enumerate(ins)]
    return ir.Op(0, prim, tuple(vals), (ir.Value(99, (8, 8), out),), tuple(sorted(params.items())))


@pytest.mark.parametrize("op,why", [
    (_op("div", ["uint32", "uint32"], "uint32"), "div of a uint32 value"),
    (_op("reduce_sum", ["uint32"], "uint32", axes=(1,)), "reduce_sum of a uint32 value"),
    (_op("convert_element_type", ["float32"], "uint32"), "convert_element_type from float32 to uint32"),
    (_op("shift_left", ["float32", "float32"], "float32"), "shift_left of a float32 value"),
    (_op("bitcast_convert_type", ["float32"], "bfloat16"), "bitcast_convert_type from float32 to bfloat16"),
])
def test_integer_ops_outside_what_kernels_do_have_reasons(op, why):
    assert why in (opdefs.unsupported_reason(op) or ""), opdefs.unsupported_reason(op)


def test_integer_ops_kernels_do_join():
    for op in (_op("xor", ["uint32", "uint32"], "uint32"), _op("shift_right_arithmetic", ["int32", "int32"], "int32"),
               _op("bitcast_convert_type", ["uint32"], "float32"), _op("convert_element_type", ["uint32"], "float32"),
               _op("lt", ["uint32", "uint32"], "bool")):
        assert opdefs.unsupported_reason(op) is None, op
