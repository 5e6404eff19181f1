"""Data-moving ops in regions (plan/views.py), on the CPU: every region is rewritten to gathers of its
inputs, and the rewritten ops, evaluated here with numpy, must give what the region's own equations
give with XLA; the kernels compile with NVRTC where it is installed."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxstitch
from jaxstitch.core import ir
from jaxstitch.graph import partition as partition_mod
from jaxstitch.driver import pipeline
from jaxstitch.frontend import trace as trace_mod
from jaxstitch.plan import views
from jaxstitch.plan.layout import Unplannable, place
from strategies import assert_same_as_jax_jit, force_stitching, traced_values


def rope(x, cos, sin):
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def rms_rope(x, w, cos, sin):
    """GPT-style: RMSNorm, heads, rotary embedding on each head's halves."""
    y = x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w
    y = y.reshape(x.shape[0], 4, 32)
    return rope(y, cos[:, None, :], sin[:, None, :])


def rms_rope_grad(x, w, cos, sin):
    return jax.grad(lambda *a: jnp.sum(rms_rope(*a) ** 2), argnums=(0, 1))(x, w, cos, sin)


def softmax_of_slice(x):
    return jax.nn.softmax(x[:, 3:67], -1)  # starts off a vector


def strided_rev(x):
    z = jnp.flip(x[:, ::2], -1)
    return z - z.max(-1, keepdims=True)


def padded_centering(x):
    p = jnp.pad(x, ((0, 0), (2, 3)), constant_values=1.5)
    return p - p.mean(-1, keepdims=True), lax.pad(x, jnp.zeros((), x.dtype), ((0, 0, 0), (-1, 2, 0)))[:, ::3].sum(-1)


def three_pieces(x, y):
    """(Normalised by a sum of squares: a plain row sum of terms of both signs can cancel, and
    bfloat16 roundings of it then moved outputs by 2.8% of their scale on a GPU.)"""
    c = jnp.concatenate([x, jnp.exp(y), x * 2], -1)
    return c / jnp.square(c).sum(-1, keepdims=True)


def rows_stacked(x, y):
    c = jnp.concatenate([x, y], 0)
    return jax.nn.softmax(c, -1)


def heads_transposed(x):  # [B, S, H, D] -> [B, H, S, D]: the minor axis stays
    return jax.nn.softmax(jnp.transpose(x, (0, 2, 1, 3)) * 2, -1)


def dynamic_window(x, i):
    return jax.nn.softmax(lax.dynamic_slice(x, (i, 0), (8, 64)), -1), lax.dynamic_slice(x, (2, 1), (4, 60)).sum(-1)


def merged_then_sliced(x):  # a reshape merging axes of a computed value, then a slice
    return jnp.sum(jnp.tanh(x * 2).reshape(x.shape[0], -1)[:, 5:-3] ** 2, -1)


def split_gates(g, h):  # a GRU cell's update from its gates
    r, z, n = jnp.split(g, 3, axis=-1)
    r, z = jax.nn.sigmoid(r), jax.nn.sigmoid(z)
    n = jnp.tanh(n * r)
    out = (1 - z) * n + z * h
    return out, jnp.sum(out, -1)


def rope_positions(x):
    """GPT's rotary embedding with its cos and sin tables computed from positions: [seq, half]
    tables TABLE_RATIO times smaller than x, computed apart and read through views."""
    half = x.shape[-1] // 2
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * 10000.0 ** (-jnp.arange(half) / half)
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rope_positions_grad(x):
    return jax.grad(lambda x: jnp.sum(jnp.tanh(rope_positions(x))))(x)


def f32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


CASES = {
    "rms_rope": (rms_rope, (f32(64, 128), f32(128), f32(64, 16), f32(64, 16))),
    "rms_rope_grad": (rms_rope_grad, (f32(64, 128), f32(128), f32(64, 16), f32(64, 16))),
    "softmax_of_slice": (softmax_of_slice, (f32(32, 100),)),
    "strided_rev": (strided_rev, (f32(16, 70),)),
    "padded_centering": (padded_centering, (f32(16, 40),)),
    "three_pieces": (three_pieces, (f32(8, 24), f32(8, 16))),
    "rows_stacked": (rows_stacked, (f32(12, 64), f32(20, 64))),
    "heads_transposed": (heads_transposed, (f32(2, 16, 4, 32),)),
    "dynamic_window": (dynamic_window, (f32(24, 64), jax.ShapeDtypeStruct((), jnp.int32))),
    "merged_then_sliced": (merged_then_sliced, (f32(8, 6, 10),)),
    "split_gates": (split_gates, (f32(32, 96), f32(32, 32))),
    "rope_positions": (rope_positions, (f32(4, 64, 8, 16),)),
    "rope_positions_grad": (rope_positions_grad, (f32(4, 64, 8, 16),)),
}


def attention_dropout(x, m):  # a (1, 1, q, k) mask, broadcast by the multiply itself (size-1 axes)
    return jax.nn.softmax(x * 0.125, -1) * m


def attention_dropout_broadcast(x, m):  # the same through an explicit broadcast_in_dim
    return jax.nn.softmax(x * 0.125, -1) * jnp.broadcast_to(m, x.shape)


def per_query_scale(x, m):  # (1, q, 1): neither a row (b * q) nor a column (k) of the row space
    e = jnp.exp(x - x.max(-1, keepdims=True)) * m
    return e, e.sum(-1)


def computed_mask(x, m):
    """The mask computed from an input at its own (1, 1, q, k) size: a small region of its own,
    which the softmax region reads."""
    keep = (m > -0.5).astype(x.dtype) / 0.7
    return jax.nn.softmax(x * 0.125, -1) * keep


# Inputs broadcast over only some of the row axes (plan/views.py, _spread_inputs): read through
# stride-0 views. Shapes not multiples of a vector.
SPREAD_CASES = {
    "attention_dropout": (attention_dropout, (f32(3, 5, 40, 70), f32(1, 1, 40, 70))),
    "attention_dropout_broadcast": (attention_dropout_broadcast, (f32(3, 5, 40, 70), f32(1, 1, 40, 70))),
    "per_query_scale": (per_query_scale, (f32(6, 33, 70), f32(1, 33, 1))),
    "computed_mask": (computed_mask, (f32(4, 6, 128, 136), f32(1, 1, 128, 136))),  # (a tile too big)
}


def causal_softmax(x):  # GPT's attention: jnp.tril of ones (iotas compared), broadcast over b, h
    s = x.shape[-1]
    causal = jnp.tril(jnp.ones((s, s), bool))
    return jax.nn.softmax(jnp.where(causal, x * 0.125, -1e9), axis=-1)


def sliding_window_softmax(x):  # a band of the causal mask, from integer iotas
    q = lax.broadcasted_iota(jnp.int32, x.shape[-2:], 0)
    k = lax.broadcasted_iota(jnp.int32, x.shape[-2:], 1)
    return jax.nn.softmax(jnp.where((q - k < 16) & (k <= q), x, -jnp.inf), axis=-1)


def causal_softmax_fwdbwd(x, dy):
    y, vjp = jax.vjp(causal_softmax, x)
    return y, vjp(dy)[0]


# Masks computed from positions (graph/positions.py): rebuilt at the scores' shape.
POSITIONAL_CASES = {
    "causal": (causal_softmax, (f32(3, 5, 40, 40),)),
    "sliding_window": (sliding_window_softmax, (f32(2, 3, 70, 70),)),
}


def _random(specs, seed):
    rng = np.random.default_rng(seed)
    out = []
    for s in specs:
        if s.dtype == jnp.int32:
            out.append(np.int32(rng.integers(-3, 30)))  # dynamic offsets clamp at both ends
        else:
            out.append(rng.standard_normal(s.shape).astype(np.float32))
    return out


def _traced(fun, specs):
    flat, tree = jax.tree_util.tree_flatten((tuple(specs), {}))
    traced = trace_mod.trace(fun, flat, tree)
    part = partition_mod.partition(traced.graph, fits=lambda r: pipeline._fits_one_kernel(r, jaxstitch.TARGETS["h100"]))
    return traced, part


def _gather(op, src, dyn):
    view = op.param("view")
    index = np.full(view.shape, view.offset, dtype=np.int64)
    for d, stride in enumerate(view.strides):
        shape = [1] * len(view.shape)
        shape[d] = view.shape[d]
        index = index + stride * np.arange(view.shape[d]).reshape(shape)
    for x, limit, stride in zip(dyn, view.dyn_limits, view.dyn_strides):
        index = index + int(np.clip(int(x), 0, limit)) * stride
    flat = np.asarray(src).reshape(-1)
    if view.exact:
        assert index.min() >= 0 and index.max() < flat.size, "an exact view reads outside its source"
    return flat[np.clip(index, 0, flat.size - 1)]


def _new_op(op, ins):
    """The ops sink makes that compute no traced op, with numpy."""
    out = op.outputs[0]
    p = op.prim
    if p == views.GATHER:
        return _gather(op, ins[0], ins[1:])
    if p == "iota":
        shape = [1] * len(out.shape)
        shape[op.param("dimension")] = out.shape[op.param("dimension")]
        return np.broadcast_to(np.arange(out.shape[op.param("dimension")], dtype=np.int32).reshape(shape), out.shape)
    if p in ("broadcast_in_dim",):
        x = np.asarray(ins[0])
        dims = op.param("broadcast_dimensions")
        shape = [1] * len(out.shape)
        for i, d in enumerate(dims):
            shape[d] = x.shape[i]
        return np.broadcast_to(x.reshape(shape), out.shape).astype(jnp.dtype(out.dtype))
    if p in ("reshape", "copy"):
        return np.asarray(ins[0]).reshape(out.shape)
    if p == "convert_element_type":
        return np.asarray(ins[0]).astype(jnp.dtype(out.dtype))
    fns = {"mul": np.multiply, "add": np.add, "sub": np.subtract, "lt": np.less, "le": np.less_equal,
           "ge": np.greater_equal, "and": np.logical_and,
           "select_n": lambda pred, f, t: np.where(pred, t, f)}
    return fns[p](*[np.asarray(x) for x in ins])


def _evaluate_sunk(region, traced, env, new_op=None):
    """The region's outputs, its traced ops bound with XLA and the ops sink makes with numpy
    (`new_op(op, inputs)`: those and any others a later rewrite makes, plan/pairs.py)."""
    new_op = new_op or _new_op
    local = {v.id: env[v.id] for v in region.inputs}
    for op in region.ops:
        ins = [np.asarray(a.value, dtype=jnp.dtype(a.dtype)) if isinstance(a, ir.Const) else local[a.id]
               for a in op.inputs]
        if op.index == views.NEW:
            outs = [new_op(op, ins)]
        else:  # a traced op (at other elements: its primitive, params and inputs of the new shape)
            outs = trace_mod.bind_eqn(traced.eqns[op.index], ins)
        for v, o in zip(op.outputs, outs):
            local[v.id] = np.asarray(o)
            assert local[v.id].shape == v.shape, (op.prim, local[v.id].shape, v.shape)
    return [local[v.id] for v in region.outputs]


def _sunk_regions(part):
    out = []
    for r in part.regions:
        try:
            out.append((r, views.sink(r)))
        except Unplannable:
            pass
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_sunk_regions_compute_what_the_region_does(name):
    fun, specs = CASES[name]
    traced, part = _traced(fun, specs)
    moved = [r for r in part.regions if any(op.prim in views.opdefs.VIEWS for op in r.ops)]
    assert moved, "no region holds a data-moving op"
    for seed in range(3):
        env = traced_values(traced, _random(specs, seed))
        for region, sunk in _sunk_regions(part):
            assert not any(op.prim in views.opdefs.VIEWS for op in sunk.ops)
            assert sunk.inputs == region.inputs and sunk.outputs == region.outputs
            for got, v in zip(_evaluate_sunk(sunk, traced, env), region.outputs):
                np.testing.assert_allclose(got, env[v.id], rtol=1e-6, atol=1e-6, err_msg=f"{name}: value {v.id}")


# Each case's data-moving ops end up in regions a row space holds (nothing left to XLA for them).
ONE_KERNEL = ("rms_rope", "rms_rope_grad", "softmax_of_slice", "strided_rev", "padded_centering",
              "three_pieces", "rows_stacked", "heads_transposed", "dynamic_window", "split_gates",
              "merged_then_sliced")


@pytest.mark.parametrize("name", ONE_KERNEL)
def test_data_moving_ops_join_row_space_regions(name):
    fun, specs = CASES[name]
    _, part = _traced(fun, specs)
    assert not [reason for _, reason in part.unsupported if "stitchable" in reason]
    for r in part.regions:
        place(views.sink(r))  # raises if not


def test_rms_rope_forward_and_backward_are_one_kernel_each():
    for fun in (rms_rope, rms_rope_grad):
        _, specs = CASES["rms_rope"]
        report = jaxstitch.explain(fun, *specs, target="h100")
        assert len(report.regions) == 1, report
        assert {"slice", "concatenate"} <= set(report.regions[0].ops) or "pad" in report.regions[0].ops


def test_a_transpose_of_the_minor_axis_is_left_to_xla_with_its_reason():
    def f(x):
        return jax.nn.softmax(x.T * 2, -1)
    report = jaxstitch.explain(f, f32(64, 48), target="h100")
    moved = [r for r in report.regions if "transpose" in r.ops]
    assert moved and not any(r.stitched for r in moved)
    assert any("uncoalesced" in (r.reason or "") for r in moved), report


def test_interior_padding_is_left_to_xla():
    def f(x):
        return lax.pad(x, jnp.zeros((), x.dtype), ((0, 0, 0), (1, 1, 1))).sum(-1)
    report = jaxstitch.explain(f, f32(8, 16), target="h100")
    assert "pad with interior padding" in str(report)


def test_fallback_matches_jax_jit():
    for name in ("rms_rope_grad", "dynamic_window", "split_gates"):
        fun, specs = CASES[name]
        args = _random(specs, 7)
        got = jaxstitch.jit(fun)(*args)
        want = jax.jit(fun)(*args)
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernels_with_gathers_render_and_compile(name, monkeypatch):
    """Forced stitching (any estimated gain): every region's kernel renders and NVRTC compiles it."""
    monkeypatch.setenv("JAXSTITCH_TUNE", "min_gain_pct=0")
    fun, specs = CASES[name]
    report = jaxstitch.explain(fun, *specs, target="h100")
    for r in report.regions:
        assert not r.reason or not r.reason.startswith(("codegen", "NVRTC")), r.reason
    assert any(r.stitched and set(r.ops) & views.opdefs.VIEWS for r in report.regions), report


@pytest.mark.parametrize("name", sorted(SPREAD_CASES))
def test_an_input_broadcast_over_some_row_axes_is_read_through_a_view(name):
    """The softmax and the multiply by the mask are one region, the mask a gather of stride 0 over
    the axes it repeats along; the rewrite computes what the region's equations do."""
    fun, specs = SPREAD_CASES[name]
    traced, part = _traced(fun, specs)
    (region,) = [r for r in part.regions if any(op.prim == "exp" for op in r.ops)]
    assert "mul" in {op.prim for op in region.ops}
    sunk = views.sink(region)
    gathers = [op for op in sunk.ops if op.prim == views.GATHER]
    assert gathers and all(0 in op.param("view").strides for op in gathers)
    place(sunk)  # raises if not
    for seed in range(2):
        env = traced_values(traced, _random(specs, seed))
        for got, v in zip(_evaluate_sunk(sunk, traced, env), region.outputs):
            np.testing.assert_allclose(got, env[v.id], rtol=1e-6, atol=1e-6, err_msg=f"{name}: value {v.id}")
    assert_same_as_jax_jit(fun, _random(specs, 3))


@pytest.mark.parametrize("name", list(POSITIONAL_CASES))
def test_a_mask_computed_from_positions_is_rebuilt_where_it_is_broadcast(name):
    """The mask, the scale and the softmax are one region; after sink no (q, k) value is left (the
    iotas count along the scores' own axes), the rewrite computes what the traced equations do, and
    the region is one stitched kernel with jax.jit's results."""
    fun, specs = POSITIONAL_CASES[name]
    traced, part = _traced(fun, specs)
    (region,) = part.regions
    q_k = specs[0].shape[-2:]
    assert any(v.shape == q_k for op in region.ops for v in op.outputs)
    sunk = views.sink(region)
    assert not any(v.shape == q_k for op in sunk.ops for v in op.outputs)
    place(sunk)  # raises if not
    for seed in range(2):
        env = traced_values(traced, _random(specs, seed))
        for got, v in zip(_evaluate_sunk(sunk, traced, env), region.outputs):
            np.testing.assert_allclose(got, env[v.id], rtol=1e-6, atol=1e-7, err_msg=f"{name}: value {v.id}")
    with force_stitching():  # (small: the cost model would leave it to XLA)
        (r,) = jaxstitch.explain(fun, *specs, target="h100").regions
    assert r.stitched and r.kernels == 1, r
    assert_same_as_jax_jit(fun, _random(specs, 3))


def causal_attention_grad(x, v):
    """The gradient of causal attention's output with respect to its scores: the backward softmax
    reads the broadcast mask, beyond the matrix products."""
    return jax.grad(lambda x: jnp.sum(jnp.einsum("bhqk,bhkd->bhqd", causal_softmax(x), v) ** 2))(x)


def test_a_backward_pass_computes_the_mask_again_rather_than_reading_it():
    """The softmax backward reads the broadcast mask: it takes in the mask's ops (recompute.py), so
    the forward region writes neither the (q, k) mask nor its broadcast, and both are stitched."""
    specs = (f32(4, 6, 128, 128), f32(4, 6, 128, 64))
    with force_stitching():  # (what is tested is where the mask is computed, not the cost model)
        program = pipeline.build(causal_attention_grad, list(specs), jax.tree_util.tree_structure((specs, {})),
                                 jaxstitch.get_target("h100"), jaxstitch.core.config.load())
    regions = [c for c in program.regions if any(op.prim in ("exp", "reduce_sum") for op in c.plan.region.ops)]
    assert len(regions) == 2 and all(c.stitched for c in regions), [c.plan.reason for c in regions]
    for c in regions:
        r = c.plan.region
        assert not any(v.dtype == "bool" or v.shape == (128, 128) for v in (*r.inputs, *r.outputs)), r.outputs
    assert_same_as_jax_jit(causal_attention_grad, _random(specs, 0))


def gpt_attention_grad(x, v):
    """examples/gpt_train.py's attention (scale, causal mask, softmax in float32), differentiated."""
    def attention(x):
        s = x.shape[-1]
        causal = jnp.tril(jnp.ones((s, s), bool))
        scores = jnp.where(causal, (x / jnp.sqrt(64.0)).astype(jnp.float32), -1e9)
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)
    return jax.grad(lambda x: jnp.sum(attention(x) ** 2))(x)


def test_a_backward_left_to_xla_gets_the_mask_no_kernel_wrote(monkeypatch):
    """The forward region (scale, mask, softmax) is stitched and writes neither the mask nor the
    exponentials; the backward, left to XLA by the cost model, reads both, which the stitcher
    computes for it (stitcher.make_runner: the mask from positions, the exponentials from the
    scores and the row max the forward wrote). Run here through the regions' XLA fallback: jax.jit's
    results. (The cost model stitches this backward, which XLA runs as two kernels,
    plan/diamonds.py: `diamonds=0` has it take XLA's for one kernel, to leave the backward to XLA.
    At this size it also leaves the forward to XLA, one kernel of its own: forced here.)"""
    monkeypatch.setenv("JAXSTITCH_TUNE", "diamonds=0")
    specs = (f32(4, 6, 128, 128), f32(4, 6, 128, 64))
    forward = lambda region: any(op.prim == "reduce_max" for op in region.ops)
    with force_stitching(where=forward):
        report = jaxstitch.explain(gpt_attention_grad, *specs, target="h100")
        assert [r.stitched for r in report.regions if len(r.ops) > 10] == [True, False], report
        written = [o for c in pipeline.build(
            gpt_attention_grad, list(specs), jax.tree_util.tree_structure((specs, {})),
            jaxstitch.get_target("h100"), jaxstitch.core.config.load()).regions if c.stitched
            for o in c.plan.region.outputs]
        assert [o.shape for o in written].count((4, 6, 128, 128)) == 1, written  # (the probabilities)
        args = _random(specs, 1)
        got = jaxstitch.jit(gpt_attention_grad, target="h100")(*args)
    want = jax.jit(gpt_attention_grad)(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)


def test_a_softmax_region_cut_from_its_computed_mask_stays_with_xla():
    """BERT's attention: softmax, times a dropout mask drawn at (1, 1, q, k). The mask's region
    refuses the multiply (a full-size result), which joins the softmax region (the mask read through
    a view), cut from the mask's. Here XLA runs the cut region as one kernel (a 1.05x estimate), so
    it stays XLA's. BERT's own region (flax's attention, 64.8 us in XLA by the estimates against our
    30.8 a layer) saves more than planner.CUT_MIN_SAVING_US and is stitched, since
    its step measured faster with it (an earlier measurement, 20.53 against 20.36 ms, was within noise)."""
    specs = (f32(32, 12, 128, 128), f32(1, 1, 128, 128))
    _, part = _traced(computed_mask, specs)
    assert [("mul" in {op.prim for op in r.ops}, r.cut) for r in part.regions] == [(False, True), (True, True)]
    report = jaxstitch.explain(computed_mask, *specs, target="h100")
    assert len(report.regions) == 2 and not any(r.stitched for r in report.regions), report


@pytest.mark.parametrize("dims", [[(16, 128), (128, 1)], [(16, 0), (128, 1)], [(4, -128), (128, -1)],
                                  [(3, 1), (1, 7), (5, 3)], [(2, 0), (3, 0)], [(6, 10), (10, 1), (1, 99)]])
def test_gather_index_merges_contiguous_axes(dims):
    """A gather's index (lowering/kernel._affine) merges the axes its source holds contiguously, so
    a head split of a row ([16, 128], strides 128 and 1) is read at the column itself, with no
    division or remainder left; what it computes is the strided offset of every column."""
    from jaxstitch.lowering import kernel
    expr = kernel._affine(dims, "c", column=True)
    if dims == [(16, 128), (128, 1)]:
        assert "/" not in expr and "%" not in expr
    if dims == [(16, 0), (128, 1)]:
        assert "% 128u" in expr and "/" not in expr  # a broadcast head: the column within the head
    c_code = expr.replace("(long long)", "").replace("(unsigned)", "").replace("LL", "").replace("u)", ")")
    shape = [n for n, _ in dims]
    for flat in range(int(np.prod(shape))):
        digits = np.unravel_index(flat, shape)
        want = sum(int(d) * s for d, (_, s) in zip(digits, dims))
        got = eval(c_code.replace("c", str(flat)).replace("/", "//"))  # (non-negative: C's / is //)
        assert got == want, (dims, flat, expr)


@pytest.mark.parametrize("name,predicated", [("rows_stacked", True), ("three_pieces", False)])
def test_a_concatenation_along_rows_loads_each_operand_in_its_own_rows_only(name, predicated, monkeypatch, tmp_path):
    """An operand of a concatenation along rows is loaded only in the rows it fills (FlatView.bounds:
    a predicate a row, the other rows' loads skipped, so each operand's bytes move once); along
    columns every element still loads each operand, clamped."""
    monkeypatch.setenv("JAXSTITCH_TUNE", "min_gain_pct=0")
    monkeypatch.setenv("JAXSTITCH_DUMP_DIR", str(tmp_path))
    fun, specs = CASES[name]
    jaxstitch.explain(fun, *specs, target="h100")
    sources = [p.read_text() for p in tmp_path.rglob("*.cu")]
    assert sources
    assert any("_in = (unsigned long long)" in s for s in sources) == predicated


@pytest.mark.parametrize("name", ["rope_positions", "rope_positions_grad"])
def test_tables_from_positions_are_computed_apart(name):
    """The rotary tables' pow, cos and sin (a [64, 8] table, x 64 times larger) stay out of the
    region that broadcasts them, in a small region of their own: inside, every element would
    evaluate them again (partition.TABLE_RATIO; recompute.py does not take them back in)."""
    fun, specs = CASES[name]
    report = jaxstitch.explain(fun, *specs, target="h100")
    expensive = {"pow", "cos", "sin"}
    assert [(r.rows, r.cols) for r in report.regions if expensive <= set(r.ops)] == [(64, 8)], report
    rows = [r for r in report.regions if (r.rows or 0) * (r.cols or 0) == 4 * 64 * 8 * 16]
    assert rows and not any(expensive & set(r.ops) for r in rows), report


def sliced_weight_updates(g, w1, w2, w3, m1, m2, m3):
    """An optimizer step over three parameters whose gradients come as slices of one concatenated
    gradient (a fused QKV projection's)."""
    parts = [g[:, :8], g[:, 8:16], g[:, 16:]]
    out = []
    for p, w, m in zip(parts, (w1, w2, w3), (m1, m2, m3)):
        m = 0.9 * m + 0.1 * p
        out += [w - 1e-3 * m / (jnp.sqrt(m * m) + 1e-8), m]
    return out


UNIONS = {**CASES, "sliced_weight_updates": (sliced_weight_updates, (
    f32(8, 40), f32(8, 8), f32(8, 8), f32(8, 24), f32(8, 8), f32(8, 8), f32(8, 24))),
    "rows_of_either": (lambda x, w: (x * 2.0, w * 3.0), (f32(4, 8), f32(8, 4)))}  # (neither splits the other's rows)


@pytest.mark.parametrize("name", sorted(UNIONS))
def test_never_placed_is_a_sound_no(name):
    """Of every region and every union of two regions, those never_placed refuses fail to place
    once sunk (partitioning then skips sinking them)."""
    fun, specs = UNIONS[name]
    flat, tree = jax.tree_util.tree_flatten((tuple(specs), {}))
    graph = trace_mod.trace(fun, flat, tree).graph
    part = partition_mod.partition(graph, fits=lambda r: pipeline._fits_one_kernel(r, jaxstitch.TARGETS["h100"]))
    consumers = partition_mod.consumers_of(graph)
    refused = 0
    for i, a in enumerate(part.regions):
        for b in part.regions[i:]:
            ops = sorted({op.index: op for op in (*a.ops, *b.ops)}.values(), key=lambda op: op.index)
            union = partition_mod.make_region(-1, ops, consumers)
            if views.never_placed(union):
                refused += 1
                with pytest.raises(Unplannable):
                    place(views.sink(union))
    if name in ("sliced_weight_updates", "rows_of_either"):
        assert refused


@pytest.mark.parametrize("name", sorted(UNIONS))
def test_refused_union_is_a_sound_no(name):
    """Of every union of two regions, those refused_union refuses from their members' OpsShapes
    alone (without building the union) fit no kernel: neither a row space nor a tile holds them."""
    fun, specs = UNIONS[name]
    flat, tree = jax.tree_util.tree_flatten((tuple(specs), {}))
    graph = trace_mod.trace(fun, flat, tree).graph
    target = jaxstitch.TARGETS["h100"]
    part = partition_mod.partition(graph, fits=lambda r: pipeline._fits_one_kernel(r, target))
    consumers = partition_mod.consumers_of(graph)
    refused = 0
    for i, a in enumerate(part.regions):
        for b in part.regions[i + 1:]:
            parts = [partition_mod.ops_shape(list(r.ops), consumers) for r in (a, b)]
            if views.refused_union(parts):
                refused += 1
                ops = sorted((*a.ops, *b.ops), key=lambda op: op.index)
                assert not pipeline._plans_as_one_kernel(partition_mod.make_region(-1, ops, consumers), target)
    if name == "sliced_weight_updates":
        assert refused


def test_the_quick_refusal_leaves_the_partition_as_it_was(monkeypatch):
    """GPT's QUICK bfloat16 train step partitions into the same regions with and without the merge
    across views' quick refusals (36 of its unions refused that way)."""
    pytest.importorskip("optax")
    import dataclasses
    import importlib
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from jaxstitch import api
    from jaxstitch.core import config

    gpt = importlib.import_module("gpt_train")
    c = dataclasses.replace(gpt.QUICK, dtype="bfloat16")
    graphdef, state = gpt.make_init(c, 0)()
    dyn, static, tree = api._split_dynamic((graphdef, state, gpt.make_batches(c, 0)(0)), {})
    seen = []
    refuses = pipeline._Fits.refuses

    def regions(quick: bool):
        def refuses_or_not(self, parts):
            if not quick:
                return False
            seen.append(refuses(self, parts))
            return seen[-1]
        monkeypatch.setattr(pipeline._Fits, "refuses", refuses_or_not)
        cfg = config.load()
        traced = pipeline.traced_with(gpt.train_step, dyn, tree, static, cfg)
        staged = pipeline.stage(traced, jaxstitch.TARGETS["h200"], cfg)
        return [tuple(op.index for op in r.ops) for r in staged.partition.regions]
    assert regions(True) == regions(False)
    assert sum(seen) > 0
