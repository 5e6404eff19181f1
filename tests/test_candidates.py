"""The planner's thread-mapping candidates (plan/candidates.py), on CPU for an H100: offered in the
order the driver compiles them, each mapping once, and a narrower plan only for kernels that pack
rows or pair halves."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jaxstitch
from jaxstitch.core import config
from jaxstitch.driver import pipeline
from jaxstitch.plan import candidates as cands
from jaxstitch.plan import plan_region
from jaxstitch.plan.layout import ReasonKind

TARGET = jaxstitch.get_target("h100")


def _region(fun, *specs):
    tree = jax.tree_util.tree_structure((tuple(specs), {}))
    program = pipeline.build(fun, list(specs), tree, TARGET, config.load())
    (compiled,) = [c for c in program.regions if c.stitched]
    return compiled.plan.region


def softmax_fwdbwd(x, dy):
    y = jax.nn.softmax(x, axis=-1)
    return y * (dy - jnp.sum(dy * y, axis=-1, keepdims=True))


def test_candidates_come_in_the_drivers_order_each_mapping_once():
    region = _region(softmax_fwdbwd, *[jax.ShapeDtypeStruct((4096, 8192), jnp.float32)] * 2)
    tuning = config.load().tuning
    offered = list(cands.candidates(region, TARGET, tuning))
    order = [(c.max_tpr, c.relaxed) for c in offered]
    assert order == sorted(order, key=lambda o: (-o[0], o[1]))  # caps falling, the lifted cap after
    assert offered[0].max_tpr == 1024 and not offered[0].relaxed
    mappings = [c.plan.kernel.mapping for c in offered]
    assert len(set(mappings)) == len(mappings)
    assert all(c.max_tpr in cands.tprs(tuning.max_tpr) for c in offered)


def test_the_first_candidate_is_the_plan_made_ahead():
    region = _region(softmax_fwdbwd, *[jax.ShapeDtypeStruct((4096, 8192), jnp.float32)] * 2)
    tuning = config.load().tuning
    ahead = plan_region(region, TARGET, tuning)
    first = next(cands.candidates(region, TARGET, tuning, first=ahead))
    assert first.plan is ahead


def test_a_row_a_block_has_no_narrower_plan():
    region = _region(softmax_fwdbwd, *[jax.ShapeDtypeStruct((4096, 8192), jnp.float32)] * 2)
    first = next(cands.candidates(region, TARGET, config.load().tuning))
    assert first.plan.kernel.mapping.tpr >= 32 and not first.plan.kernel.mapping.pair
    assert cands.narrower(region, TARGET, config.load().tuning, first) is None


def test_rows_packed_in_a_warp_have_a_narrower_plan_with_half_the_elements():
    region = _region(softmax_fwdbwd, *[jax.ShapeDtypeStruct((65536, 64), jnp.float32)] * 2)
    first = next(cands.candidates(region, TARGET, config.load().tuning))
    m = first.plan.kernel.mapping
    assert m.tpr < 32 and m.elems_per_thread > 2, m
    half = cands.narrower(region, TARGET, config.load().tuning, first)
    assert half is not None and half.kernel.mapping.elems_per_thread == m.elems_per_thread // 2


def test_tprs_stay_within_the_tunings_cap():
    assert cands.tprs(1024) == [1024, 512, 256]
    assert cands.tprs(512) == [512, 256]
    assert cands.tprs(128) == [128]


def test_a_region_plan_checks_its_invariants():
    """A plan left to XLA says why; a stitched one has a kernel and an estimate, and no reason's
    op or kind."""
    region = _region(softmax_fwdbwd, *[jax.ShapeDtypeStruct((4096, 8192), jnp.float32)] * 2)
    plan = plan_region(region, TARGET, config.load().tuning)
    assert plan.stitched
    with pytest.raises(ValueError, match="says why"):
        dataclasses.replace(plan, kernel=None)
    with pytest.raises(ValueError, match="says why"):
        dataclasses.replace(plan, estimate=None)
    with pytest.raises(ValueError, match="belong to a reason"):
        dataclasses.replace(plan, reason_kind=ReasonKind.COST)
    declined = dataclasses.replace(plan, reason="the test declines it", reason_kind=ReasonKind.COST)
    assert not declined.stitched


def test_the_planner_refuses_what_the_templates_cannot_render():
    """A column sum of int32 values over the grid: codegen accumulates grid-wide reductions in float,
    so the planner refuses it (kind dtype, naming the op); the tile kernels' reductions are
    lowering's functors."""
    from jaxstitch.lowering.cuda_ops import REDUCE
    from jaxstitch.plan import tile

    def int_column_sum(x):
        return jnp.sum(x * 3, axis=0)

    spec = jax.ShapeDtypeStruct((65536, 1024), jnp.int32)
    tree = jax.tree_util.tree_structure(((spec,), {}))
    program = pipeline.build(int_column_sum, [spec], tree, TARGET, config.load())
    (c,) = [c for c in program.regions if any(op.prim == "reduce_sum" for op in c.plan.region.ops)]
    assert not c.stitched and c.plan.reason_kind == ReasonKind.DTYPE, c.plan.reason
    assert "reduce_sum over the grid of a int32 value" in c.plan.reason and c.plan.reason_op is not None
    assert tile.TILE_REDUCTIONS == frozenset(REDUCE)


def test_an_unrenderable_kernel_is_refused_even_where_the_cost_model_declines_it():
    """The refusal comes before the cost model's decision: a region the cost model declines (an int32
    sum over 2 rows) is still refused for its dtype, so nothing that strips cost vetoes (the tests'
    force_stitching) can send it to codegen, where strict mode raises kernel.Unrenderable (the GPU
    fuzz sample's program)."""
    from strategies import force_stitching

    spec = jax.ShapeDtypeStruct((2, 1, 1), jnp.int32)
    tree = jax.tree_util.tree_structure(((spec,), {}))
    cfg = dataclasses.replace(config.load(), strict=True)
    with force_stitching():
        program = pipeline.build(lambda x: jnp.sum(x, axis=0), [spec], tree, TARGET, cfg)
    (c,) = [c for c in program.regions if any(op.prim == "reduce_sum" for op in c.plan.region.ops)]
    assert not c.stitched and c.plan.reason_kind == ReasonKind.DTYPE, c.plan.reason
