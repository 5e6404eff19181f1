"""A scatter-add of one value per row (or one window) into a fill, written out as a select at trace
time (jaxstitch/frontend/row_scatter.py): which scatters are, that the program then computes exactly what
jax.jit computes (the pipeline run on the CPU for a GPU target, regions through XLA), and that an
integer-label cross-entropy's gradient becomes one stitched kernel."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jaxstitch
from jaxstitch.frontend import trace as trace_mod


def xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def picked_grad(x, idx):
    """take_along_axis over the last axis of a rank-3 array, differentiated."""
    return jax.grad(lambda x: jnp.sum(jnp.take_along_axis(x, idx, axis=-1) ** 2))(x)


def window_grad(x):
    """jnp.take of one column (a window scatter in the gradient)."""
    return jax.grad(lambda x: jnp.sum(jnp.take(x, 3, axis=-1) * 2.0))(x)


def raw_scatter(upd, idx, mode):
    """One update per row into zeros, indices as given (out of range ones included)."""
    dn = lax.ScatterDimensionNumbers(update_window_dims=(), inserted_window_dims=(1,),
                                     scatter_dims_to_operand_dims=(1,), operand_batching_dims=(0,),
                                     scatter_indices_batching_dims=(0,))
    zeros = jnp.zeros((upd.shape[0], 50), upd.dtype)
    return lax.scatter_add(zeros, idx[:, None, None], upd[:, None], dn, mode=mode)


def into_live(x, upd, idx):
    """The same scatter into a live array: left a scatter (it may run in place)."""
    dn = lax.ScatterDimensionNumbers(update_window_dims=(), inserted_window_dims=(1,),
                                     scatter_dims_to_operand_dims=(1,), operand_batching_dims=(0,),
                                     scatter_indices_batching_dims=(0,))
    return lax.scatter_add(x, idx[:, None, None], upd[:, None], dn,
                           mode=lax.GatherScatterMode.FILL_OR_DROP)


def _prims(fun, *args) -> list[str]:
    traced = trace_mod.trace(fun, list(args), trace_mod.positional_tree(args))
    return [op.prim for op in traced.graph.ops]


def _rng(seed=0):
    return np.random.default_rng(seed)


def test_a_cross_entropy_gradient_has_no_scatter_left():
    logits, labels = jnp.ones((8, 100)), jnp.zeros((8,), jnp.int32)
    prims = _prims(jax.grad(xent), logits, labels)
    assert "scatter-add" not in prims and "iota" in prims and "select_n" in prims


def test_scatters_into_live_arrays_or_clipped_stay_scatters():
    x, upd, idx = jnp.ones((4, 50)), jnp.ones((4,)), jnp.zeros((4,), jnp.int32)
    assert "scatter-add" in _prims(into_live, x, upd, idx)
    assert "scatter-add" in _prims(lambda u, i: raw_scatter(u, i, lax.GatherScatterMode.CLIP), upd, idx)
    assert "scatter-add" not in _prims(lambda u, i: raw_scatter(u, i, lax.GatherScatterMode.FILL_OR_DROP), upd, idx)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_cross_entropy_gradient_is_jax_jits(dtype):
    r = _rng(1)
    logits = jnp.asarray(r.standard_normal((64, 1000)), dtype)
    labels = jnp.asarray(r.integers(-1000, 1000, (64,)), jnp.int32)  # negative labels count from the end
    fun = jax.grad(xent)
    got, want = jaxstitch.jit(fun, target="h100")(logits, labels), jax.jit(fun)(logits, labels)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("mode", [lax.GatherScatterMode.FILL_OR_DROP, lax.GatherScatterMode.PROMISE_IN_BOUNDS])
def test_out_of_range_indices_add_nothing(mode):
    r = _rng(2)
    upd = jnp.asarray(r.standard_normal(32), jnp.float32).at[0].set(-0.0)
    if mode == lax.GatherScatterMode.FILL_OR_DROP:
        idx = jnp.asarray(r.integers(-60, 110, (32,)), jnp.int32)  # many out of range, both sides
    else:
        idx = jnp.asarray(r.integers(0, 50, (32,)), jnp.int32)
    fun = lambda u, i: raw_scatter(u, i, mode)  # noqa: E731
    got, want = jaxstitch.jit(fun, target="h100")(upd, idx), jax.jit(fun)(upd, idx)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # (-0.0 == 0.0: see row_scatter)


def test_rank_three_rows_and_windows_are_jax_jits():
    r = _rng(3)
    x = jnp.asarray(r.standard_normal((6, 5, 40)), jnp.float32)
    idx = jnp.asarray(r.integers(0, 40, (6, 5, 1)), jnp.int32)
    for fun, args in ((picked_grad, (x, idx)), (window_grad, (x,))):
        assert "scatter-add" not in _prims(fun, *args), fun.__name__
        got, want = jaxstitch.jit(fun, target="h100")(*args), jax.jit(fun)(*args)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_language_model_loss_gradient_is_one_stitched_kernel():
    """GPT's loss over a 32k vocabulary: the softmax's gradient and the label's one-hot in one
    kernel, nothing of the scatter left to XLA (it used to fill the logits' shape and add it)."""
    logits = jax.ShapeDtypeStruct((4096, 32000), jnp.float32)
    labels = jax.ShapeDtypeStruct((4096,), jnp.int32)
    report = jaxstitch.explain(jax.grad(xent), logits, labels, target="h200")
    big = [r for r in report.regions if r.rows == 4096 and r.cols == 32000]
    assert len(big) == 1 and big[0].stitched and big[0].kernels == 1, report
    assert "add_any" in big[0].ops and "iota" in big[0].ops, report
    assert "left to XLA: scatter-add" not in str(report) and dict(report.rewritten)["scatter-add"] == 2, report
    assert "written out as other ops:\n  2 scatter-add" in str(report), report


def test_scatters_zero_keeps_the_scatter(monkeypatch):
    """JAXSTITCH_TUNE=scatters=0 (an ablation): the scatter stays, left to XLA."""
    monkeypatch.setenv("JAXSTITCH_TUNE", "scatters=0")
    logits = jax.ShapeDtypeStruct((256, 4000), jnp.float32)
    labels = jax.ShapeDtypeStruct((256,), jnp.int32)
    report = jaxstitch.explain(jax.grad(xent), logits, labels, target="h200")
    assert "scatter-add" in str(report), report


def test_a_float32_copy_that_only_a_gather_reads_is_not_written():
    """Logits cast to float32 inside the loss: the gather of the labels' logits reads the cast, which
    the stitched kernel would otherwise write in full (as many bytes as the gradient); XLA computes
    it again at the gathered elements instead (recompute._drop_unread)."""
    from jaxstitch.bench.workloads import WORKLOADS

    w = WORKLOADS["xent_labels_fwdbwd"]
    args = jax.eval_shape(lambda k: w.make_inputs(k, jnp.dtype(jnp.bfloat16), False), jax.random.key(0))
    report = jaxstitch.explain(w.fn, *args, target="h100")
    big = [r for r in report.regions if r.stitched and r.cols == 32000]
    assert len(big) == 1 and big[0].est_bytes < 2 * 4096 * 32000 * 2 + 10**6, report  # bf16 in, bf16 out
