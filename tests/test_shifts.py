"""Row-constant shifts taken out of row reductions (plan/shifts.py), on the CPU: the rewritten regions,
evaluated here with numpy, give what the traced regions give with XLA (a max bit for bit, special
values included; a float32 sum within its rounding), and the planner takes the rewrite only where it
saves a pass over the rows."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstitch
from jaxstitch.core import ir
from jaxstitch.graph import partition as partition_mod
from jaxstitch.driver import pipeline
from jaxstitch.frontend import trace as trace_mod
from jaxstitch.plan import cost, online, shifts, views
from jaxstitch.plan.layout import place
from jaxstitch.bench.workloads import softmax_fwdbwd
from strategies import traced_values


def token_stats(x):
    lp = jax.nn.log_softmax(x, axis=-1)
    return lp.mean(-1), jnp.max(lp, -1)


def smoothed_loss(x, labels):
    """Label smoothing's uniform part and the picked log-probability, as optax writes them out."""
    lp = jax.nn.log_softmax(x, axis=-1)
    picked = jnp.take_along_axis(lp, labels[:, None], -1)[:, 0]
    return -(0.9 * picked + 0.1 * lp.mean(-1))


def token_logprob_select(x, labels):
    """log p(label) as a masked row sum (jaxstitch.bench.workloads.token_logprob), in float32 of x."""
    lp = jax.nn.log_softmax(x.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.where(jnp.arange(x.shape[-1]) == labels[:, None], lp, 0.0), -1)


def token_logprob_one_hot(x, labels):
    """The same as a one-hot product (a cross-entropy's forward), with the row's max beside."""
    lp = jax.nn.log_softmax(x, axis=-1)
    return -jnp.sum(jax.nn.one_hot(labels, x.shape[-1]) * lp, -1), jnp.max(x, -1)


def label_smoothing(x, labels):
    """Float weights (not a mask): their zeros times an infinite shift are NaN, so this keeps its pass."""
    lp = jax.nn.log_softmax(x, axis=-1)
    w = 0.9 * jax.nn.one_hot(labels, x.shape[-1]) + 0.1 / x.shape[-1]
    return -jnp.sum(w * lp, -1)


def centered_max(x, y):
    """A max shifted by another row's max: that shift may be -inf beside a finite x (not taken out)."""
    return jnp.max(x - jnp.max(y, -1, keepdims=True), -1), jnp.sum(x - jnp.max(y, -1, keepdims=True), -1)


def plain_and_centered_sums(x):
    """A row's own sum beside a sum of it shifted by its max: two different sums of x."""
    return x.sum(-1), (x - x.max(-1, keepdims=True)).sum(-1), x.max(-1)


def log_softmax_and_mean(x):
    """The full log-softmax is written anyway: its pass over the rows stays, so nothing is rewritten."""
    lp = jax.nn.log_softmax(x, axis=-1)
    return lp, lp.mean(-1)


def _regions(fun, specs):
    flat, tree = jax.tree_util.tree_flatten((tuple(specs), {}))
    traced = trace_mod.trace(fun, flat, tree)
    part = partition_mod.partition(traced.graph, fits=lambda r: pipeline._fits_one_kernel(r, jaxstitch.TARGETS["h100"]))
    return traced, part.regions


def _bind(eqn, ins):
    """A traced equation, its row maxima NaN-propagating as on the GPU (XLA's CPU reduce_max skips
    NaN: an all-NaN row gives -inf there)."""
    if eqn.primitive.name == "reduce_max":
        return [np.max(ins[0], axis=tuple(eqn.params["axes"]))]
    return trace_mod.bind_eqn(eqn, ins)


def _values(traced, args):
    return traced_values(traced, args, _bind)


def _new_op(op, ins):
    out = op.outputs[0]
    dt = jnp.dtype(out.dtype)
    if op.prim == "reduce_sum":
        return np.sum(ins[0], axis=tuple(op.param("axes")), dtype=np.float32).astype(dt)
    if op.prim == "reduce_max":
        return np.max(ins[0], axis=tuple(op.param("axes")))
    if op.prim == "reshape":
        return np.asarray(ins[0]).reshape(out.shape)
    if op.prim == views.GATHER:  # (the pilot's: no dynamic offsets)
        view = op.param("view")
        index = np.full(view.shape, view.offset, dtype=np.int64)
        for d, stride in enumerate(view.strides):
            index = index + stride * np.arange(view.shape[d]).reshape([-1 if e == d else 1 for e in range(len(view.shape))])
        return np.asarray(ins[0]).reshape(-1)[index]
    if op.prim == "neg":
        return -np.asarray(ins[0])
    if op.prim == "is_finite":
        return np.isfinite(ins[0])
    if op.prim == "eq":
        return np.equal(*ins)
    if op.prim == "convert_element_type":
        return np.asarray(ins[0]).astype(dt)
    if op.prim == "select_n":
        return np.where(ins[0], ins[2], ins[1]).astype(dt)
    if op.prim == "broadcast_in_dim":
        return np.broadcast_to(np.asarray(ins[0]), out.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        return {"mul": np.multiply, "sub": np.subtract, "add": np.add, "div": np.divide}[op.prim](*ins).astype(dt)


def _evaluate(region, traced, env):
    local = {v.id: env[v.id] for v in region.inputs}
    for op in region.ops:
        ins = [np.asarray(a.value, dtype=jnp.dtype(a.dtype)) if isinstance(a, ir.Const) else local[a.id]
               for a in op.inputs]
        outs = [_new_op(op, ins)] if op.index == shifts.NEW else _bind(traced.eqns[op.index], ins)
        for v, o in zip(op.outputs, outs):
            local[v.id] = np.asarray(o)
            assert local[v.id].shape == v.shape, (op.prim, local[v.id].shape, v.shape)
    return [local[v.id] for v in region.outputs]


def _placed(region):
    """The region's online sums and its layout, as the planner places it."""
    found = online.find_online_sums(region.ops)
    return found, place(region, online.sum_ids(found))


def _pulled(region):
    return shifts.pull_out(region, _placed(region)[1])


def _passes(region):
    """The region's passes over its rows, as the planner counts them."""
    found, layout = _placed(region)
    return cost.chunk_passes(layout, region.ops, region.outputs, found)


def _logits(rng, rows, cols, offset=0.0, special=False):
    x = (rng.standard_normal((rows, cols)) * 3 + offset).astype(np.float32)
    if special:  # rows of -inf beside finite values, all -inf, an +inf, a NaN
        x[0, ::7] = -np.inf
        x[1, :] = -np.inf
        x[2, 5] = np.inf
        x[3, 9] = np.nan
        x[4, :] = np.float32(-3e38)
    return x


@pytest.mark.parametrize("offset, special", [(0.0, False), (100.0, False), (-30.0, False), (0.0, True)])
def test_token_stats_rewritten_give_the_traced_results(offset, special):
    rows, cols = 8, 3000
    traced, regions = _regions(token_stats, [jax.ShapeDtypeStruct((rows, cols), jnp.float32)])
    (region,) = regions
    rewritten, n = _pulled(region)
    assert n == 2  # the mean's sum and the max
    assert _passes(rewritten) == 1
    rng = np.random.default_rng(7)
    for _ in range(3):
        x = _logits(rng, rows, cols, offset, special)
        env = _values(traced, [x])
        (mean, mx) = _evaluate(rewritten, traced, env)
        want_mean, want_max = (env[v.id] for v in region.outputs)
        np.testing.assert_array_equal(mx, want_max)  # bit for bit, NaN and infinities in place
        np.testing.assert_array_equal(np.isnan(mean), np.isnan(want_mean))
        finite = np.isfinite(want_mean)
        np.testing.assert_array_equal(mean[~finite], want_mean[~finite])
        # float32 sums: within the rounding the shift itself carries (eps * |offset| / |result|)
        np.testing.assert_allclose(mean[finite], want_mean[finite], rtol=2e-6 * (1 + abs(offset) / 10))


@pytest.mark.parametrize("fun", [token_logprob_select, token_logprob_one_hot])
@pytest.mark.parametrize("offset, special", [(0.0, False), (100.0, False), (0.0, True)])
def test_masked_sums_rewritten_give_the_traced_results(fun, offset, special):
    """A picked log-probability in the first pass: sum(m (x - p)) - k (C - p). Labels out of range
    (no pick: 0 whatever the row's shift) and picks of -inf, +inf and NaN entries included."""
    rows, cols = 8, 3000
    specs = [jax.ShapeDtypeStruct((rows, cols), jnp.float32), jax.ShapeDtypeStruct((rows,), jnp.int32)]
    traced, regions = _regions(fun, specs)
    (region,) = regions
    rewritten, n = _pulled(region)
    assert n == 1
    assert _passes(rewritten) == 1
    rng = np.random.default_rng(17)
    for _ in range(3):
        x = _logits(rng, rows, cols, offset, special)
        labels = rng.integers(0, cols, rows).astype(np.int32)
        labels[:5] = [0, 3, 5, 9, 7]  # on the -inf, beside the all -inf row, the +inf, the NaN
        labels[6] = -1  # no class
        env = _values(traced, [x, labels])
        for got, v in zip(_evaluate(rewritten, traced, env), region.outputs):
            want = env[v.id]
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            finite = np.isfinite(want)
            np.testing.assert_array_equal(got[~finite], want[~finite])
            np.testing.assert_allclose(got[finite], want[finite], rtol=2e-6 * (1 + abs(offset) / 10), atol=1e-5)
        assert env[traced.graph.outputs[0].id][6] == 0  # (the picked log-probability: no class, 0)


@pytest.mark.parametrize("offset, special", [(0.0, False), (40.0, False), (0.0, True)])
def test_softmax_backward_factor_comes_out_of_its_sum(offset, special):
    """JAX's softmax backward sums dy * s^-2 * exp(x - max): the row factor s^-2 comes out (one
    rewrite), the rest is a sum weighted by dy that folds into the max's pass (plan/online.py), so a
    pass fewer; the rewritten region gives the traced results, special values in place."""
    rows, cols = 8, 3000
    spec = jax.ShapeDtypeStruct((rows, cols), jnp.float32)
    traced, (region,) = _regions(softmax_fwdbwd, [spec, spec])
    rewritten, n = _pulled(region)
    assert n == 1 and _passes(rewritten) == 2 < _passes(region)
    (pair,) = _placed(rewritten)[0]
    (weighted,) = pair.weighted
    assert weighted.weight_id == region.inputs[1].id  # dy
    rng = np.random.default_rng(5)
    for _ in range(3):
        x, dy = _logits(rng, rows, cols, offset, special), rng.standard_normal((rows, cols)).astype(np.float32)
        env = _values(traced, [x, dy])
        for got, v in zip(_evaluate(rewritten, traced, env), region.outputs):
            want = env[v.id]
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            finite = np.isfinite(want)
            np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-9)


def test_float_weighted_sums_keep_their_pass():
    traced, regions = _regions(label_smoothing, [jax.ShapeDtypeStruct((8, 3000), jnp.float32),
                                                 jax.ShapeDtypeStruct((8,), jnp.int32)])
    for region in regions:
        assert _pulled(region)[1] == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_token_logprob_is_one_pass(dtype):
    """The suite's token_logprob (a bfloat16 input converted to float32: the pilot is loaded and
    converted) reads each row once, with no stash."""
    from jaxstitch.bench.workloads import token_logprob
    specs = [jax.ShapeDtypeStruct((4096, 32000), jnp.dtype(dtype)), jax.ShapeDtypeStruct((4096,), jnp.int32)]
    (r,) = jaxstitch.explain(token_logprob, *specs, target="h100").regions
    assert r.stitched and "one pass" in r.mapping and "shifts out of 1 reductions" in r.mapping, r.mapping
    assert "stash" not in r.mapping, r.mapping


def test_smoothed_loss_uniform_part_comes_out_of_the_second_pass():
    traced, regions = _regions(smoothed_loss, [jax.ShapeDtypeStruct((8, 3000), jnp.float32),
                                               jax.ShapeDtypeStruct((8,), jnp.int32)])
    rng = np.random.default_rng(3)
    x, labels = _logits(rng, 8, 3000), rng.integers(0, 3000, 8).astype(np.int32)
    env = _values(traced, [x, labels])
    changed = 0
    for region in regions:
        rewritten, n = _pulled(region)
        changed += n
        for got, v in zip(_evaluate(rewritten, traced, env), region.outputs):
            np.testing.assert_allclose(got, env[v.id], rtol=2e-6)
    assert changed >= 1


def test_a_rows_own_sum_is_not_taken_for_its_shifted_sum():
    traced, regions = _regions(plain_and_centered_sums, [jax.ShapeDtypeStruct((8, 3000), jnp.float32)])
    (region,) = regions
    rewritten, n = _pulled(region)
    assert n == 1
    env = _values(traced, [_logits(np.random.default_rng(11), 8, 3000, offset=5.0)])
    for got, v in zip(_evaluate(rewritten, traced, env), region.outputs):
        np.testing.assert_allclose(got, env[v.id], rtol=2e-6, atol=2e-3)


def test_a_max_shifted_by_another_rows_max_keeps_its_shift():
    specs = [jax.ShapeDtypeStruct((8, 3000), jnp.float32)] * 2
    traced, regions = _regions(centered_max, specs)
    (region,) = regions
    rewritten, n = _pulled(region)
    assert n == 1  # the sum only: y's max may be -inf beside a finite x
    maxes = [op for op in rewritten.ops if op.prim == "reduce_max"]
    assert any(op.index != shifts.NEW and op.inputs[0].shape == (8, 3000) and op.inputs[0] not in region.inputs
               for op in maxes)
    rng = np.random.default_rng(5)
    x, y = _logits(rng, 8, 3000), _logits(rng, 8, 3000)
    y[2, :] = -np.inf
    env = _values(traced, [x, y])
    for got, v in zip(_evaluate(rewritten, traced, env), region.outputs):
        np.testing.assert_allclose(got, env[v.id], rtol=2e-6)


def test_half_precision_sums_keep_their_shifts():
    traced, regions = _regions(token_stats, [jax.ShapeDtypeStruct((8, 3000), jnp.bfloat16)])
    (region,) = regions
    rewritten, n = _pulled(region)
    assert n <= 1  # at most the max (exact in any precision); the bfloat16 sum stays two-pass
    assert [op.prim for op in rewritten.ops if op.index == shifts.NEW].count("reduce_sum") == 0


@pytest.mark.parametrize("rows", [34, 128])
def test_long_rows_statistics_read_each_row_once(rows, monkeypatch):
    spec = jax.ShapeDtypeStruct((rows, 262144), jnp.float32)
    (r,) = jaxstitch.explain(token_stats, spec, target="h100").regions
    assert r.stitched and r.kernels == 1
    assert "one pass" in r.mapping and "shifts out of 2 reductions" in r.mapping, r.mapping
    monkeypatch.setenv("JAXSTITCH_TUNE", "shifts=0")
    (before,) = jaxstitch.explain(token_stats, spec, target="h100").regions
    assert "shifts" not in before.mapping and "one pass" not in before.mapping
    assert r.est_bytes == before.est_bytes and r.est_us < before.est_us


def test_nothing_is_rewritten_where_a_pass_stays():
    spec = jax.ShapeDtypeStruct((64, 32768), jnp.float32)
    for r in jaxstitch.explain(log_softmax_and_mean, spec, target="h100").regions:
        assert "shifts" not in (r.mapping or "")
