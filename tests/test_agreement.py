"""Our kernels compute what XLA computes where the bits decide a result (CPU: the plans and sources).

Three random programs gave wrong gradients on an H200 (GPU checks: test_gpu_agreement.py):
* a conversion round trip `x.astype(bf16).astype(f32)`, which XLA drops and our kernels honoured
  (fp_conversions.py);
* a comparison of a bfloat16 value computed unrounded in our kernel with a maximum another kernel
  had stored rounded (cuda_ops.as_stored);
* a value compared with its own maximum, recomputed in three kernels, one of them XLA's
  (pinned_values.py).
Also here: `jnp.roll`'s NumPy-integer params, which crashed planning.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxstitch
from jaxstitch.core import config
from jaxstitch.frontend import fp_conversions, predicate_products, trace as trace_mod
from jaxstitch.graph import pinned_values
from jaxstitch.driver import pipeline

S = jax.ShapeDtypeStruct


def _program(fn, *specs):
    tree = jax.tree_util.tree_structure((tuple(specs), {}))
    return pipeline.build(fn, list(specs), tree, jaxstitch.get_target("h200"), config.load())


def _grad(f, n):
    """jax.grad of sum(f(...) * ct) with respect to the first n arguments (the fuzzer's form)."""
    def loss(*a):
        *xs, cts = a
        outs = f(*xs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(outs, cts))
    return jax.grad(loss, argnums=tuple(range(n)))


def round_trip_cumsum(x, y):
    s = jnp.sin(x.astype(jnp.bfloat16).astype(jnp.float32))
    return lax.cumsum(x, axis=3) - jnp.where(s <= 0.5, s, y)


def column_max_of_a_round_trip(x, y):
    v3 = x.astype(jnp.float16).astype(jnp.float32)
    v6 = jnp.exp(v3 - jnp.max(v3, axis=0, keepdims=True))
    v7 = jnp.sum(v6, axis=0, keepdims=True)
    v10 = x / (jnp.abs(jnp.mean(x, axis=1)[:, None]) + 0.5)
    causal = lax.broadcasted_iota(jnp.int32, x.shape, 1) >= lax.broadcasted_iota(jnp.int32, x.shape, 0)
    v13 = jnp.where(x >= 0.0, jnp.where(causal, v10, -1e4), 0.0)
    return jnp.maximum(v13 + jnp.sin(v10), v6 / v7), v7


def column_softmax_bf16(x):
    v3 = x * jnp.log(jnp.abs(x) + 1)
    v3 = jnp.maximum(v3, v3)
    v6 = jnp.exp(v3 - jnp.max(v3, axis=0, keepdims=True))
    return x.astype(jnp.float32) - v6 / jnp.sum(v6, axis=0, keepdims=True)


def test_conversion_chains_collapse_as_xla_collapses_them():
    closed = jax.make_jaxpr(lambda x: (jnp.sin(x.astype(jnp.bfloat16).astype(jnp.float32)),
                                       x.astype(jnp.bfloat16).astype(jnp.float16)))(jnp.zeros(4, jnp.float32))
    traced = trace_mod.from_closed(closed)
    converts = [op for op in traced.graph.ops if op.prim == "convert_element_type"]
    x = traced.graph.inputs[0]
    # each conversion after the first reads x itself: to float32 (the identity), to float16 directly
    assert {(op.inputs[0].id, op.outputs[0].dtype) for op in converts} >= {(x.id, "float32"), (x.id, "float16")}
    assert dict(traced.rewritten)[fp_conversions.REPORTED] == 2


def test_excess_precision_off_keeps_the_round_trip(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_allow_excess_precision=false")
    assert not config.load().excess_precision
    spec = S((64, 256), jnp.float32)
    program = _program(lambda x: jnp.sin(x.astype(jnp.bfloat16).astype(jnp.float32)), spec)
    ops = program.traced.graph.ops
    assert [op.inputs[0].dtype for op in ops if op.prim == "convert_element_type"] == ["float32", "bfloat16"]


def test_round_trip_region_computes_with_x_unrounded():
    specs = [S((31, 3, 2, 127), jnp.float32)] * 3
    program = _program(_grad(round_trip_cumsum, 2), specs[0], specs[1], (specs[2],))
    bodies = [c.source.split('extern "C"', 1)[1] for c in program.regions if c.source]
    assert bodies
    assert not any("js_round_bf16" in body for body in bodies)


def test_a_compare_of_half_values_reads_them_rounded():
    program = _program(_grad(column_softmax_bf16, 1), S((2793, 4096), jnp.bfloat16), (S((2793, 4096), jnp.float32),))
    compares = [line for c in program.regions if c.source for line in c.source.splitlines()
                if " == " in line and "v" in line and "[e] = (" in line]
    assert compares, "expected the max gradient's compares in a stitched kernel"
    assert all(line.count("js_round_bf16(") == 2 for line in compares), compares


def test_a_value_compared_with_its_maximum_is_computed_once():
    """`v3 = maximum(v, v)` meets `max(v3, axis=0)` in an equality: one kernel computes it, the
    others (XLA's among them) read it; `log(|x| + 1)`, which only arithmetic reads, may be
    recomputed."""
    program = _program(_grad(column_softmax_bf16, 1), S((2793, 4096), jnp.bfloat16), (S((2793, 4096), jnp.float32),))
    (v3,) = [op for op in program.traced.graph.ops if op.prim == "max"]
    holding = [c.plan.region.id for c in program.regions if v3 in c.plan.region.ops]
    assert len(holding) == 1, f"maximum(v, v) is computed in regions {holding}"
    readers = [c for c in program.regions if v3.outputs[0] in c.plan.region.inputs]
    assert readers


def test_pinned_values_are_the_shared_rounded_ancestors_of_a_compare():
    closed = jax.make_jaxpr(lambda x: jnp.where(x * 3 == jnp.max(x * 3, axis=1, keepdims=True), 1.0, 0.0))(
        jnp.zeros((4, 8), jnp.float32))
    graph = trace_mod.from_closed(closed).graph
    mul = next(op for op in graph.ops if op.prim == "mul")
    assert pinned_values.pinned(graph) == {mul.outputs[0].id}
    # computed without rounding (a max of x and a negation): nothing to pin
    closed = jax.make_jaxpr(lambda x: jnp.where(-x == jnp.max(-x, axis=1, keepdims=True), 1.0, 0.0))(
        jnp.zeros((4, 8), jnp.float32))
    assert pinned_values.pinned(trace_mod.from_closed(closed).graph) == frozenset()


def _found_on_the_gpu_softmax_of_a_product():
    """A float16 program whose last kernel recomputed `x * x` unrounded and subtracted the maximum
    XLA had found among the rounded products (H200)."""
    from fuzz_programs import FuzzProgram

    return FuzzProgram(shape=(3, 64, 3, 3), inputs=("float16",), steps=(
        ("binary", "mul", 0, 0), ("binary", "div", 1, 1), ("roll", 0, -289, 2), ("mask", 1, 3, 2, 0.0),
        ("reduce", "max", 3, (1, 2, 3), False), ("roll", 5, -2191, 0), ("unary", "squash", 1),
        ("reduce", "sum", 7, (0, 1, 2, 3), True), ("scan", "cumsum", 2, 2, False), ("softmax", 1, 1)),
        outputs=(10, 5), grad=False, nan_inf=False)


def test_ops_computed_in_two_kernels_round_half_results_as_xla():
    """Every copy of a recomputed op, and its original, is marked shared; each stitched kernel
    computing the float16 product rounds it (js_round_f16), as XLA does, so `x*x - max(x*x)` is 0 at
    the maximum in every kernel."""
    from strategies import force_stitching

    program = _found_on_the_gpu_softmax_of_a_product()
    with force_stitching():
        built = _program(program.function(), S(program.shape, jnp.float16))
    (mul,) = [op for op in built.traced.graph.ops if op.prim == "mul"]
    holding = [c for c in built.regions if mul in c.plan.region.ops]
    assert any(mul.index in c.plan.region.recomputed for c in holding)
    assert all(mul.index in c.plan.region.shared for c in holding)
    sources = [c.source for c in holding if c.stitched]
    product = re.compile(rf"\bv{mul.outputs[0].id}(\[e\])? = js_round_f16\(")
    assert sources and all(product.search(code) for code in sources), sources


def test_ops_computed_once_keep_float():
    """A float16 softmax in one kernel computes its product once: nothing shared, nothing rounded
    before the store."""
    built = _program(lambda x: jax.nn.softmax(x * x, axis=1), S((4096, 512), jnp.float16))
    assert all(not c.plan.region.shared for c in built.regions)


def test_a_product_with_a_converted_predicate_is_xlas_select():
    """The gradient of a maximum multiplies by `x == max(x)` converted: where the maximum is NaN,
    jax.jit (XLA's select) gives 0, the product as written `inf * 0`. The traced equations, bound
    one by one outside jit (no XLA rewrite), give jax.jit's values."""
    x = jnp.array([1.0, jnp.nan, -2.0, 3.0], jnp.float32)
    f = jax.grad(lambda x: jnp.max(jnp.mean(x, keepdims=True)))
    closed = jax.make_jaxpr(f)(x)
    traced = trace_mod.from_closed(closed)
    assert dict(traced.rewritten).get(predicate_products.REPORTED) == 1
    (got,) = trace_mod.evaluate(traced.eqns, traced.graph.inputs, [x], traced.graph.outputs, traced.consts)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(f)(x)))
    # half precision alike (as XLA on an H200); integers stay products
    closed = jax.make_jaxpr(lambda x, p: p.astype(jnp.bfloat16) * x)(x.astype(jnp.bfloat16), x > 0)
    assert dict(trace_mod.from_closed(closed).rewritten).get(predicate_products.REPORTED) == 1
    closed = jax.make_jaxpr(lambda x, p: x * p.astype(jnp.int32))(x.astype(jnp.int32), x > 0)
    assert predicate_products.REPORTED not in dict(trace_mod.from_closed(closed).rewritten)


@pytest.mark.parametrize("shape,shift,axis", [((8192,), 3937, 0), ((1, 1, 1), 22, 1), ((4, 6), -2, 1)])
def test_roll_plans(shape, shift, axis):
    report = jaxstitch.explain(lambda x: jnp.roll(x, shift, axis) * 2, S(shape, jnp.float32), target="h200")
    assert report.regions


def test_numpy_scalar_params_are_kept():
    closed = jax.make_jaxpr(lambda x: lax.concatenate([x, x], np.int64(0)))(jnp.zeros(3))
    graph = trace_mod.from_closed(closed).graph
    (op,) = [op for op in graph.ops if op.prim == "concatenate"]
    assert op.param("dimension") == 0 and isinstance(op.param("dimension"), int)


def test_the_three_programs_plan_on_a_cpu():
    """The shapes and forms of the GPU test; planning them must not raise."""
    for fn, specs in ((_grad(round_trip_cumsum, 2), ([S((7, 2, 2, 127), jnp.float32)] * 2, (S((7, 2, 2, 127), jnp.float32),))),
                      (_grad(column_max_of_a_round_trip, 2), ([S((127, 4097), jnp.float32)] * 2,
                                                               (S((127, 4097), jnp.float32), S((1, 4097), jnp.float32))))):
        args, cts = specs
        assert jaxstitch.explain(fn, *args, cts, target="h200").regions
