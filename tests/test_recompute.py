"""Cheap producers recomputed inside a region (recompute.py), on CPU, planned for an H100.

The backward half of an RMSNorm-like function reads `h = f32(x) - mean`, a float32 chain of the
bfloat16 `x`, across a matrix product. Read from memory, `h` would be written by the forward pass
first (XLA alone would fuse the chain into both consumers); recomputed, the region reads `x`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstitch
from jaxstitch import config, pipeline
from strategies import force_stitching, random_inputs

S = jax.ShapeDtypeStruct
SPECS = [S((512, 768), jnp.bfloat16), S((768, 768), jnp.float32)]


def norm_across_a_dot(x, w):
    xf = x.astype(jnp.float32)
    h = xf - jnp.mean(xf, -1, keepdims=True)
    y = h @ w
    return y, jnp.sum(y * h, -1, keepdims=True) * h


def _regions(monkeypatch, tune):
    monkeypatch.setenv("JAXSTITCH_TUNE", tune)
    tree = jax.tree_util.tree_structure((tuple(SPECS), {}))
    program = pipeline.build(norm_across_a_dot, list(SPECS), tree, jaxstitch.get_target("h100"), config.load())
    dot = next(op.index for op in program.traced.graph.ops if op.prim == "dot_general")
    (after,) = [c.plan.region for c in program.regions if c.plan.region.ops[-1].index > dot]
    return after


def test_the_region_after_the_dot_recomputes_h_from_the_bfloat16_input(monkeypatch):
    after = _regions(monkeypatch, "")
    full = [v for v in after.inputs if v.shape == (512, 768)]
    assert after.recomputed, "the chain f32(x) - mean should be recomputed"
    assert {v.dtype for v in full} == {"bfloat16", "float32"}, full  # x, and y from the dot
    assert len(full) == 2
    assert {op.prim for op in after.ops if op.index in after.recomputed} <= {"convert_element_type", "sub",
                                                                            "broadcast_in_dim", "reshape"}


def test_recompute_off_reads_h(monkeypatch):
    after = _regions(monkeypatch, "recompute=0")
    assert not after.recomputed
    assert sorted(v.dtype for v in after.inputs if v.shape == (512, 768)) == ["float32", "float32"]


@pytest.mark.parametrize("tune", ["", "recompute=0"])
def test_recomputed_regions_give_jax_jit_results(monkeypatch, tune):
    monkeypatch.setenv("JAXSTITCH_TUNE", tune)
    args = random_inputs(SPECS, 5)
    with force_stitching():
        got = jaxstitch.jit(norm_across_a_dot, target="h100")(*args)
    want = jax.jit(norm_across_a_dot)(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
