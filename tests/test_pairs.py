"""Rotated halves read from registers (plan/pairs.py), on the CPU: the paired region, evaluated with
numpy, gives the sunk region's values bit for bit; the planner pairs exactly the regions it should;
a paired mapping's JS_VEC_COL deals every column of a row to one thread slot, each beside its
partner; the kernels compile with NVRTC where it is installed."""
from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxstitch
from jaxstitch import targets
from jaxstitch.kernels import nvrtc
from jaxstitch.lowering import codegen
from jaxstitch.lowering.kernel import vec_col_definition
from jaxstitch.plan import pairs, planner, views
from jaxstitch.plan.layout import PAIR_HALF, PAIR_SWAP, place
from jaxstitch.core.config import Tuning
from strategies import traced_values
from test_views import CASES as VIEW_CASES, _evaluate_sunk, _new_op, _random, _traced, rope


def f32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def rope_only(x, cos, sin):
    """Rotary embedding of [tokens, heads, 64] with no reduction: rows are the tokens' heads."""
    return rope(x, cos[:, None, :], sin[:, None, :])


def rotate_half(x, cos, sin):
    """Hugging Face Llama's form: x * cos + rotate_half(x) * sin, cos and sin a head wide, after an
    RMS norm over the token's heads."""
    h = x.shape[-1] // 2
    y = x * lax.rsqrt(jnp.mean(x * x, (-2, -1), keepdims=True) + 1e-6)
    rotated = jnp.concatenate([-y[..., h:], y[..., :h]], -1)
    return y * cos[:, None, :] + rotated * sin[:, None, :]


def rope_grad(x, cos, sin, dy):
    return jax.vjp(lambda x: rope_only(x, cos, sin), x)[1](dy)[0]


def shifted_by_one(x):
    """A neighbour one column away: no halves to pair."""
    y = jnp.concatenate([x[..., 1:], x[..., :1]], -1)
    return jax.nn.softmax(x * y, -1)


PAIR_CASES = {
    "rms_rope": VIEW_CASES["rms_rope"],  # (heads of 32)
    "rms_rope_grad": VIEW_CASES["rms_rope_grad"],
    "rope_only": (rope_only, (f32(6, 3, 64), f32(6, 32), f32(6, 32))),
    "rotate_half": (rotate_half, (f32(5, 2, 64), f32(5, 64), f32(5, 64))),
    "rope_grad": (rope_grad, (f32(6, 3, 64), f32(6, 32), f32(6, 32), f32(6, 3, 64))),
}
HALF = {"rms_rope": 16, "rms_rope_grad": 16}  # (else half the last axis)


def _paired_regions(part):
    out = []
    for r in part.regions:
        try:
            sunk = views.sink(r)
            paired = pairs.pair(sunk, place(sunk))
        except views.Unplannable:
            continue
        if paired is not None:
            out.append((r, sunk, *paired))
    return out


def _evaluate_paired(region, traced, env, h):
    """_evaluate_sunk with the pair ops in numpy, on the row space's columns."""
    c = place(region).n_cols

    def new_op(op, ins):
        out = op.outputs[0]
        if op.prim == PAIR_HALF:
            second = (np.arange(c) // h) % 2 == 1
            cols = second if op.param("second") else ~second
            return np.broadcast_to(cols, (out.size // c, c)).reshape(out.shape)
        if op.prim == PAIR_SWAP:
            x = np.asarray(ins[0])
            swapped = x.reshape(-1, c // (2 * h), 2, h)[:, :, ::-1, :].reshape(-1, c)
            return np.broadcast_to(swapped, (out.size // c, c)).reshape(out.shape)  # (a column's)
        return _new_op(op, ins)

    return _evaluate_sunk(region, traced, env, new_op)


@pytest.mark.parametrize("name", sorted(PAIR_CASES))
def test_paired_regions_compute_what_the_sunk_region_does(name):
    fun, specs = PAIR_CASES[name]
    traced, part = _traced(fun, specs)
    found = _paired_regions(part)
    assert found, "no region was paired"
    for region, sunk, paired, h in found:
        ops = {op.prim for op in paired.ops}
        assert PAIR_HALF in ops and (PAIR_SWAP in ops or name == "rotate_half")  # (its base is not read)
        assert h == HALF.get(name, specs[0].shape[-1] // 2)
        for seed in range(3):
            env = traced_values(traced, _random(specs, seed))
            want = _evaluate_sunk(sunk, traced, env)
            for got, ref, v in zip(_evaluate_paired(paired, traced, env, h), want, region.outputs):
                np.testing.assert_array_equal(got, ref, err_msg=f"{name}: value {v.id}")


def test_a_shift_by_one_column_is_not_paired():
    fun, specs = shifted_by_one, (f32(8, 64),)
    _, part = _traced(fun, specs)
    assert part.regions and not _paired_regions(part)


def test_rope_forward_and_backward_drop_their_gathers_of_the_other_half():
    """The rotary forward and backward read each input once: every gather left either reads a
    column's own value (cos and sin of the first half) or is the fallback of a swap that serves the
    other half."""
    for name in ("rms_rope", "rms_rope_grad"):
        fun, specs = PAIR_CASES[name]
        _, part = _traced(fun, specs)
        (_, sunk, paired, _), = _paired_regions(part)
        before = sum(op.prim == views.GATHER for op in sunk.ops)
        swaps = sum(op.prim == PAIR_SWAP for op in paired.ops)
        assert swaps >= before // 2, (name, before, swaps)


@pytest.mark.parametrize("name", sorted(PAIR_CASES))
def test_the_planner_pairs_halves_and_the_kernel_compiles(name):
    fun, specs = PAIR_CASES[name]
    _, part = _traced(fun, specs)
    target = targets.get_target("h100")
    plans = [planner.plan_region(r, target, Tuning(min_gain_pct=0)) for r in part.regions]
    paired = [p for p in plans if p.kernel is not None and getattr(p.kernel.mapping, "pair", 0)]
    assert paired, [p.reason for p in plans]
    for p in paired:
        assert "paired" in p.kernel.mapping.name
        source = codegen.render(p.kernel).code
        swaps = any(op.prim == PAIR_SWAP for op in p.kernel.region.ops)
        assert "JS_VEC_COL" in source and ("^ V]" in source) == swaps
    off = [planner.plan_region(r, target, Tuning(min_gain_pct=0, pairs=0)) for r in part.regions]
    assert not any(p.kernel is not None and getattr(p.kernel.mapping, "pair", 0) for p in off)


def _columns(definition: str, tpr: int, vpt: int, vec: int, chunks: int = 1) -> np.ndarray:
    """JS_VEC_COL evaluated (C integer division of non-negative ints) for every chunk, slot and
    lane: [chunks, vpt, tpr] first columns."""
    expr = re.sub(r"\bVPT\b", str(vpt), re.sub(r"\bTPR\b", str(tpr), re.sub(r"\bV\b", str(vec), definition)))
    expr = expr.replace("/", "//")
    out = np.zeros((chunks, vpt, tpr), dtype=np.int64)
    for ch, k, lane in itertools.product(range(chunks), range(vpt), range(tpr)):
        out[ch, k, lane] = eval(expr, {"ch": ch, "k": k, "lane": lane})
    return out


@pytest.mark.parametrize("h,vec,tpr,vpt", [(64, 4, 256, 2), (64, 8, 128, 2), (16, 4, 8, 4), (32, 2, 64, 4), (8, 8, 1, 2)])
def test_a_paired_mapping_deals_every_column_once_beside_its_partner(h, vec, tpr, vpt):
    first = _columns(vec_col_definition(h, vec), tpr, vpt, vec)[0]
    cols = (first[..., None] + np.arange(vec)).reshape(-1)
    assert sorted(cols) == list(range(tpr * vpt * vec))
    assert ((first[0::2] // h) % 2 == 0).all() and (first[1::2] == first[0::2] + h).all()


def test_the_unpaired_definition_is_the_row_in_turns():
    first = _columns(vec_col_definition(0, 4), 32, 3, 4, chunks=2)
    assert (first.reshape(-1) == np.arange(0, 2 * 3 * 32 * 4, 4)).all()


def test_rows_too_long_to_hold_are_planned_unpaired():
    """A row a block cannot hold in registers (walked in chunks, or split over blocks) does not pair
    its halves: the region is planned as before, through gathers."""
    fun, _ = VIEW_CASES["rms_rope"]

    def long_rope(x, w, cos, sin):  # heads of 32 over rows of 65536
        y = x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w
        return rope(y.reshape(x.shape[0], -1, 32), cos[:, None, :], sin[:, None, :])

    specs = (f32(8, 65536), f32(65536), f32(8, 16), f32(8, 16))
    _, part = _traced(long_rope, specs)
    plans = [planner.plan_region(r, targets.get_target("h100"), Tuning(min_gain_pct=0)) for r in part.regions]
    assert any(p.kernel is not None and not p.kernel.mapping.pair
               and (p.kernel.mapping.chunks > 1 or p.kernel.mapping.splits > 1) for p in plans), [p.reason for p in plans]
    report = jaxstitch.explain(long_rope, *specs, target="h100")  # (the report says why)
    assert any("halves of 16 paired: halves of 16 columns cannot be paired" in alt for r in report.regions for alt in r.alternatives), str(report)


@pytest.mark.skipif(not nvrtc.available(), reason="NVRTC is not installed (pip install 'jaxstitch[cuda]')")
def test_a_spilling_paired_kernel_is_planned_with_half_the_elements():
    """The RMS norm + rotary fwd+bwd in bfloat16 spills at 16 elements a thread under its register
    cap; it is planned again at 8 (vectors of 4) instead of lifting the cap."""
    from jaxstitch.bench import workloads
    w = workloads.WORKLOADS["rmsnorm_rope_fwdbwd"]
    args = jax.eval_shape(lambda k: w.make_inputs(k, jnp.bfloat16, False), jax.random.key(0))
    report = jaxstitch.explain(w.fn, *args, target="h200")
    (region,) = [r for r in report.regions if r.stitched]
    assert "paired" in region.mapping
    assert any("16 elements a thread" in alt for alt in region.alternatives), region.alternatives


def test_row_parts_broadcast_over_different_axes_differ():
    """A source read per batch in one gather and per head in another (stride 0 on the other axis)
    reads different addresses for the same row: their row parts must not compare equal."""
    per_batch, per_head = [(4, 100), (3, 0)], [(4, 0), (3, 100)]
    assert views.merged_axes(per_batch) != views.merged_axes(per_head)
    assert views.merged_axes([(1, 5), (8, 64), (16, 4)]) != views.merged_axes([(8, 64), (16, 0)])
    assert views.merged_axes([(8, 64), (16, 4)]) == ((128, 4),)  # (contiguous: one axis)
    assert views.merged_axes([(8, 0), (16, 0)]) == ((128, 0),)   # (broadcast over both)
