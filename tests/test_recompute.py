"""Cheap producers recomputed inside a region (recompute.py), on CPU, planned for an H100.

The backward half of an RMSNorm-like function reads `h = f32(x) - mean`, a float32 chain of the
bfloat16 `x`, across a matrix product. Read from memory, `h` would be written by the forward pass
first (XLA alone would fuse the chain into both consumers); recomputed, the region reads `x`.

Where `x` is itself made inside the forward region (a residual sum, as in a transformer's layer
norm), taking the chain in makes the forward pass write `x` where it wrote `h`: worth it only
counting the write of `h`, which the region after the product alone reads (recompute=2). In
float32 `x` is as wide as `h`, and the region after the product reads `x - mean` and `2 * x`: each
chain alone costs as much as it saves, the two together share `x`. A region reading the halves of
one value (a merged product's gate and up halves) reads them in place, through the slices.
"""
from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstitch
from jaxstitch.core import config
from jaxstitch.driver import pipeline
from jaxstitch.plan import candidates
from strategies import force_stitching, random_inputs

S = jax.ShapeDtypeStruct
SPECS = [S((512, 768), jnp.bfloat16), S((768, 768), jnp.float32)]


def norm_across_a_dot(x, w):
    xf = x.astype(jnp.float32)
    h = xf - jnp.mean(xf, -1, keepdims=True)
    y = h @ w
    return y, jnp.sum(y * h, -1, keepdims=True) * h


def _program(monkeypatch, tune, fun, specs):
    monkeypatch.setenv("JAXSTITCH_TUNE", tune)
    tree = jax.tree_util.tree_structure((tuple(specs), {}))
    return pipeline.build(fun, list(specs), tree, jaxstitch.get_target("h100"), config.load())


def _regions(monkeypatch, tune):
    program = _program(monkeypatch, tune, norm_across_a_dot, SPECS)
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


RESIDUAL_SPECS = [S((512, 768), jnp.bfloat16), S((512, 768), jnp.bfloat16), S((768, 768), jnp.bfloat16)]


def residual_norm_across_a_dot(a, b, w):
    """h = f32(a + b) - mean is read by the forward norm and by the region after the product only."""
    xf = (a + b).astype(jnp.float32)
    h = xf - jnp.mean(xf, -1, keepdims=True)
    y = (h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)).astype(a.dtype)
    z = y @ w
    return z, jnp.sum(z.astype(jnp.float32) * h, -1, keepdims=True) * h


def _residual_program(monkeypatch, tune):
    program = _program(monkeypatch, tune, residual_norm_across_a_dot, RESIDUAL_SPECS)
    dot = next(op.index for op in program.traced.graph.ops if op.prim == "dot_general")
    (before,) = [c.plan.region for c in program.regions if c.plan.region.ops[-1].index < dot]
    (after,) = [c.plan.region for c in program.regions if c.plan.region.ops[-1].index > dot]
    return before, after


def test_an_input_only_one_region_reads_counts_its_write(monkeypatch):
    before, after = _residual_program(monkeypatch, "")
    assert after.recomputed, "the chain f32(a + b) - mean should be recomputed after the product"
    full = sorted(v.dtype for v in after.inputs if v.shape == (512, 768))
    assert full == ["bfloat16", "bfloat16"], after.inputs  # a + b, and z from the product
    written = sorted(v.dtype for v in before.outputs if v.shape == (512, 768))
    assert written == ["bfloat16", "bfloat16"], before.outputs  # y for the product, and a + b (not h)


def test_counting_reads_alone_keeps_reading_h(monkeypatch):
    _, after = _residual_program(monkeypatch, "recompute=1")
    assert not after.recomputed
    assert sorted(v.dtype for v in after.inputs if v.shape == (512, 768)) == ["bfloat16", "float32"]


SHARED_SPECS = [S((512, 768), jnp.float32), S((512, 768), jnp.float32), S((768, 768), jnp.float32)]


def shared_leaf_across_a_dot(a, b, w):
    """After the product, `x - mean` and `2 * x` of the forward region's x = a + b."""
    x = a + b
    h = x - jnp.mean(x, -1, keepdims=True)
    y = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)
    z = y @ w
    return z, jnp.sum(z * h, -1, keepdims=True) * (2 * x)


def _shared_program(monkeypatch, tune):
    program = _program(monkeypatch, tune, shared_leaf_across_a_dot, SHARED_SPECS)
    (z,) = next(op.outputs for op in program.traced.graph.ops if op.prim == "dot_general")
    (after,) = [c.plan.region for c in program.regions if z in c.plan.region.inputs]
    return after


@pytest.mark.parametrize("tune, wide_inputs", [("", 2), ("recompute=1", 3)])
def test_chains_sharing_a_leaf_are_taken_in_together(monkeypatch, tune, wide_inputs):
    after = _shared_program(monkeypatch, tune)
    assert len([v for v in after.inputs if v.shape == (512, 768)]) == wide_inputs, after.inputs
    assert bool(after.recomputed) == (wide_inputs == 2)


@contextlib.contextmanager
def readers_left_to_xla():
    """Every region stitched except those that recompute a chain: XLA runs those after all, and
    needs the value their producer no longer writes (the stitcher rebuilds it from the leaves)."""
    with force_stitching():
        forced = pipeline.plan_region

        def plan(*args, **kwargs):
            p = forced(*args, **kwargs)
            return dataclasses.replace(p, reason="declined by the test") if p.region.recomputed else p

        pipeline.plan_region = candidates.plan_region = plan
        try:
            yield
        finally:
            pipeline.plan_region = candidates.plan_region = forced


@pytest.mark.parametrize("tune", ["", "recompute=1"])
@pytest.mark.parametrize("declined", [False, True])
@pytest.mark.parametrize("fun, specs", [(residual_norm_across_a_dot, RESIDUAL_SPECS),
                                        (shared_leaf_across_a_dot, SHARED_SPECS)])
def test_residual_regions_give_jax_jit_results(monkeypatch, tune, declined, fun, specs):
    monkeypatch.setenv("JAXSTITCH_TUNE", tune)
    args = random_inputs(specs, 6)
    with (readers_left_to_xla() if declined else force_stitching()):
        got = jaxstitch.jit(fun, target="h100")(*args)
    want = jax.jit(fun)(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-5, atol=1e-5)


SLICED_SPECS = [S((512, 256), jnp.bfloat16), S((128, 128), jnp.bfloat16)]


def halves_across_a_dot(z, w):
    """A gated unit over the halves of one value (a SwiGLU's gate and up halves of one merged
    product), the halves read again after the product."""
    g, u = z[:, :128], z[:, 128:]
    y = (jax.nn.silu(g) * u) @ w
    return y * jax.nn.sigmoid(g) + u


def test_a_region_reads_slices_where_their_value_is(monkeypatch):
    """The region after the product reads z through the slices, at the slices' elements: the same
    bytes as reading g and u, which no one need write any more (XLA fuses its own slices)."""
    program = _program(monkeypatch, "", halves_across_a_dot, SLICED_SPECS)
    dot = next(op for op in program.traced.graph.ops if op.prim == "dot_general")
    (y,), h = dot.outputs, dot.inputs[0]
    (after,) = [c.plan.region for c in program.regions if y in c.plan.region.inputs]
    z = program.traced.graph.inputs[0]
    assert z in after.inputs, after.inputs
    assert not [v for v in after.inputs if v.shape == (512, 128) and v is not y], after.inputs
    assert "slice" in {op.prim for op in after.ops if op.index in after.recomputed}
    before = [c.plan.region for c in program.regions if c.plan.region is not after]
    assert [o for r in before for o in r.outputs] == [h], "g and u still written"


@pytest.mark.parametrize("tune", ["", "recompute=0"])
@pytest.mark.parametrize("declined", [False, True])
def test_sliced_regions_give_jax_jit_results(monkeypatch, tune, declined):
    """Declined: XLA runs the region after the product, and slices z itself."""
    monkeypatch.setenv("JAXSTITCH_TUNE", tune)
    args = random_inputs(SLICED_SPECS, 8)
    with (readers_left_to_xla() if declined else force_stitching()):
        got = jaxstitch.jit(halves_across_a_dot, target="h100")(*args)
    want = jax.jit(halves_across_a_dot)(*args)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


# (512 tokens: at 256 the softmax regions move under 4 MB, which the cost model leaves to XLA as
# launch-bound, planner.LAUNCH_BOUND_BYTES)
ATTENTION_SPECS = [S((2, 512, 4, 64), jnp.bfloat16)] * 4


def gpt_attention_grads(q, k, v, w):
    """examples/gpt_train.py's attention (the scale divided in the products' dtype, a causal mask
    and softmax in float32, the probabilities cast back) under a loss whose cotangent depends on the
    output, so that the backward's softmax is a region of its own, across products, as in the
    model's step."""
    def attention(q, k, v):
        s, d = q.shape[1], q.shape[-1]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d).astype(q.dtype)
        causal = jnp.tril(jnp.ones((s, s), bool))
        scores = jnp.where(causal, scores.astype(jnp.float32), -1e9)
        probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    loss = lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) ** 2 * w.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def _softmax_regions(monkeypatch, tune, specs=ATTENTION_SPECS):
    program = _program(monkeypatch, tune, gpt_attention_grads, specs)
    producer = {o.id: op.prim for op in program.traced.graph.ops for o in op.outputs}
    regions = [c.plan.region for c in program.regions if c.stitched]
    forward = [r for r in regions if any(op.prim == "reduce_max" for op in r.ops)]
    backward = [r for r in regions if r not in forward]
    assert len(forward) == 1 and len(backward) == 1, [r.ops for r in regions]
    return forward[0], backward[0], producer


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_attention_forward_writes_only_the_probabilities(monkeypatch, dtype):
    """The backward recomputes the masked scores' exponentials: formerly from the scaled
    scores, which the forward wrote for it, and the forward also wrote the float32 exponentials
    (their chain runs through the causal mask, which no kernel writes, so _drop_unread kept them).
    Now the backward reads the scores the product wrote (the scaling is one division by a
    constant: _swaps_for_written) and the forward writes the probabilities alone (GPT bfloat16:
    1.2 GB less a step by the plan's bytes)."""
    specs = [S(s.shape, dtype) for s in ATTENTION_SPECS]
    scores = (2, 4, 512, 512)
    forward, backward, producer = _softmax_regions(monkeypatch, "", specs)
    assert [o.shape for o in forward.outputs].count(scores) == 1, forward.outputs
    assert [producer[v.id] for v in backward.inputs if v.shape == scores] == ["dot_general"] * 2, backward.inputs
    forward, backward, producer = _softmax_regions(monkeypatch, "recompute=2", specs)
    old = 3 if dtype == jnp.bfloat16 else 2  # (in float32 the scaled scores are the exponentials' input)
    assert [o.shape for o in forward.outputs].count(scores) == old, forward.outputs


@pytest.mark.parametrize("tune", ["", "recompute=2"])
@pytest.mark.parametrize("declined", [False, True])
def test_attention_regions_give_jax_jit_results(monkeypatch, tune, declined):
    """Declined: XLA runs the backward, and the stitcher rebuilds the exponentials the forward no
    longer writes, from the scores and the causal mask's positions."""
    monkeypatch.setenv("JAXSTITCH_TUNE", tune)
    specs = [S((2, 64, 2, 32), jnp.float32)] * 4
    args = random_inputs(specs, 9)
    with (readers_left_to_xla() if declined else force_stitching()):
        got = jaxstitch.jit(gpt_attention_grads, target="h100")(*args)
    want = jax.jit(gpt_attention_grads)(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
