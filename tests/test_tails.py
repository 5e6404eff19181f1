"""A column reduction's elementwise tail moves into the one region that reads it (graph/tails.py), on
CPU, planned for an H200: a bias gradient's `0.1 g` and `0.001 g^2` (Adam's moments) belong to the
optimizer's update, so the reduction's region writes `g` alone (and, split over devices, ends with
its all-reduce: tests/test_spmd.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxstitch
from jaxstitch.core import config
from jaxstitch.driver import pipeline

S = jax.ShapeDtypeStruct
X, V = S((8192, 768), jnp.float32), S((768,), jnp.float32)


def adam_on_a_bias(x, m, v, p):
    g = jnp.sum(x * 2.0, axis=0)
    m2, v2 = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
    return p - 0.01 * m2 / (jnp.sqrt(v2) + 1e-8), m2, v2


def _partition(monkeypatch, tune: str, fun, specs):
    monkeypatch.setenv("JAXSTITCH_TUNE", tune)
    tree = jax.tree_util.tree_structure((tuple(specs), {}))
    program = pipeline.build(fun, list(specs), tree, jaxstitch.get_target("h200"), config.load())
    return program.partition.regions


def _holding(regions, prim):
    return [r for r in regions if any(op.prim == prim for op in r.ops)]


@pytest.mark.parametrize("tails", [0, 1])
def test_the_moments_tail_goes_to_the_update(monkeypatch, tails):
    regions = _partition(monkeypatch, f"tails={tails}", adam_on_a_bias, [X, V, V, V])
    (reduction,) = _holding(regions, "reduce_sum")
    (update,) = _holding(regions, "sqrt")
    assert update is not reduction
    tail_in_reduction = [op.prim for op in reduction.ops if op.index not in reduction.recomputed][2:]
    if tails:
        assert tail_in_reduction == [] and [o.shape for o in reduction.outputs] == [(768,)]
        assert {o.id for o in reduction.outputs} <= {v.id for v in update.inputs}  # g itself
    else:
        assert tail_in_reduction == ["mul", "mul", "mul"]  # 0.1 g, g g, 0.001 g^2


def test_a_tail_the_program_returns_stays(monkeypatch):
    def mean_and_update(x, p):
        s = jnp.sum(x, axis=0)
        return s * (1.0 / x.shape[0]), p + s

    regions = _partition(monkeypatch, "tails=1", mean_and_update, [X, V])
    (reduction,) = _holding(regions, "reduce_sum")
    assert [op.prim for op in reduction.ops].count("mul") == 1


def test_a_tail_a_product_also_reads_stays(monkeypatch):
    """Read by an op no region holds (a matrix product, XLA's), the tail is written anyway: it stays
    where it is, not computed twice."""
    def tail_and_product(x, p, w):
        t = 0.1 * jnp.sum(x, axis=0)
        return p + t, t @ w

    regions = _partition(monkeypatch, "tails=1", tail_and_product, [X, V, S((768, 768), jnp.float32)])
    (reduction,) = _holding(regions, "reduce_sum")
    assert [op.prim for op in reduction.ops] == ["reduce_sum", "mul"]
