"""A half-precision scatter-add into a fill (an embedding lookup's gradient) written out at trace time
as a float32 scatter rounded once (jaxstitch/frontend/wide_scatter.py), on the CPU: which scatters are, that
the program computes exactly the float32 formulation, jax.jit's bits where no index repeats, and a
sum nearer the exact one than jax.jit's where indices repeat."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstitch
from jaxstitch.frontend import trace as trace_mod

VOCAB, HIDDEN = 300, 64


def embedding_grad(table, ids, dy):
    """The table's gradient through a half-precision lookup (nnx.Embed with dtype=bfloat16)."""
    def f(w):
        rows = jnp.take(w.astype(dy.dtype), ids, axis=0)
        return jnp.vdot(rows.astype(jnp.float32), dy.astype(jnp.float32))
    return jax.grad(f)(table)


def widened(table, ids, dy):
    """What the rewrite computes, written by hand: updates added in float32, rounded once."""
    total = jnp.zeros(table.shape, jnp.float32).at[ids.reshape(-1)].add(dy.reshape(-1, dy.shape[-1]).astype(jnp.float32))
    return total.astype(dy.dtype).astype(jnp.float32)


def _inputs(dtype, ids, seed=0):
    r = np.random.default_rng(seed)
    table = jnp.asarray(r.standard_normal((VOCAB, HIDDEN)), jnp.float32)
    dy = jnp.asarray(r.standard_normal((*ids.shape, HIDDEN)), dtype)
    return table, jnp.asarray(ids, jnp.int32), dy


def _trace(fun, *args, **options):
    return trace_mod.trace(fun, list(args), trace_mod.positional_tree(args), **options)


def _scatter_dtypes(traced) -> list[str]:
    return [op.outputs[0].dtype for op in traced.graph.ops if op.prim == "scatter-add"]


def _repeating_ids(seed=1):
    """Ids of 8 sequences of 64 tokens, a fifth of them one [MASK] id, the rest random."""
    r = np.random.default_rng(seed)
    ids = r.integers(0, VOCAB, (8, 64))
    ids[:, ::5] = 7
    return ids


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_half_precision_embedding_gradient_scatters_in_float32(dtype):
    traced = _trace(embedding_grad, *_inputs(dtype, _repeating_ids()))
    assert _scatter_dtypes(traced) == ["float32"]
    # into a float32 fill broadcast from the literal, not a convert of the half-precision one (a
    # table-sized op a region could take in and write)
    producer = {o.id: op for op in traced.graph.ops for o in op.outputs}
    scatter = next(op for op in traced.graph.ops if op.prim == "scatter-add")
    fill = producer[scatter.inputs[0].id]
    assert fill.prim == "broadcast_in_dim" and fill.inputs[0].dtype == "float32", fill


def test_a_float32_scatter_is_left_as_it_is():
    traced = _trace(embedding_grad, *_inputs(jnp.float32, _repeating_ids()))
    assert not traced.rewritten and _scatter_dtypes(traced) == ["float32"]


def test_a_few_ids_into_a_large_table_keep_the_half_precision_scatter():
    """Fewer update elements than a sixteenth of the table: widening would move more bytes (the
    float32 fill and result) than the half-precision atomics cost."""
    assert _scatter_dtypes(_trace(embedding_grad, *_inputs(jnp.bfloat16, np.array([[3, 7, 7, 9]])))) == ["bfloat16"]


def test_wide_scatters_zero_keeps_the_half_precision_scatter():
    traced = _trace(embedding_grad, *_inputs(jnp.bfloat16, _repeating_ids()), wide_scatters=False)
    assert _scatter_dtypes(traced) == ["bfloat16"]


def test_one_value_a_row_stays_a_select():
    """take_along_axis's gradient in bfloat16 is row_scatter.py's select, not a widened scatter."""
    x = jnp.ones((8, 100), jnp.bfloat16)
    idx = jnp.zeros((8, 1), jnp.int32)
    fun = jax.grad(lambda x: jnp.sum(jnp.take_along_axis(x, idx, axis=-1).astype(jnp.float32)))
    assert _scatter_dtypes(_trace(fun, x)) == []


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_the_gradient_is_the_float32_sum(dtype):
    """The sum rounded to `dtype` and widened back to the table's float32 is a round trip XLA (with
    excess precision) and the trace collapse (fp_conversions.py): the float32 sum itself."""
    args = _inputs(dtype, _repeating_ids())
    got = jaxstitch.jit(embedding_grad, target="h100")(*args)
    table, ids, dy = args
    total = jnp.zeros(table.shape, jnp.float32).at[ids.reshape(-1)].add(dy.reshape(-1, dy.shape[-1]).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(total))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_without_excess_precision_the_gradient_is_the_float32_sum_rounded_once(dtype, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_allow_excess_precision=false")
    args = _inputs(dtype, _repeating_ids())
    got = jaxstitch.jit(embedding_grad, target="h100")(*args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(widened)(*args)))


def test_without_repeats_the_gradient_is_jax_jits():
    ids = np.random.default_rng(2).permutation(VOCAB)[:256].reshape(4, 64)
    args = _inputs(jnp.bfloat16, ids)
    got = jaxstitch.jit(embedding_grad, target="h100")(*args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(embedding_grad)(*args)))


def test_with_repeats_the_gradient_is_nearer_the_exact_sum_than_jax_jits():
    table, ids, dy = _inputs(jnp.bfloat16, _repeating_ids())
    exact = np.zeros((VOCAB, HIDDEN))
    np.add.at(exact, np.asarray(ids).reshape(-1), np.asarray(dy.astype(jnp.float32), np.float64).reshape(-1, HIDDEN))
    ours = np.asarray(jaxstitch.jit(embedding_grad, target="h100")(table, ids, dy), np.float64)
    xla = np.asarray(jax.jit(embedding_grad)(table, ids, dy), np.float64)
    row = 7  # the id in a fifth of the places: 103 adds
    ours_err, xla_err = np.abs(ours[row] - exact[row]).max(), np.abs(xla[row] - exact[row]).max()
    assert ours_err <= 2.0 ** -8 * np.abs(exact[row]).max(), ours_err  # one rounding at most
    assert ours_err < xla_err, (ours_err, xla_err)


def test_the_report_counts_the_widened_scatter():
    args = _inputs(jnp.bfloat16, _repeating_ids())
    report = jaxstitch.explain(embedding_grad, *args, target="h100")
    assert dict(report.rewritten).get("scatter-add in float32") == 1, report
    assert "1 scatter-add in float32 (half precision into a fill" in str(report), report
