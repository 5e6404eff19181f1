"""Matrix products merged over concatenations (merged_products.py), on CPU, planned for an H100.

A SwiGLU MLP in bfloat16 has three mergeable groups: the forward's gate and up products (one input
shared, weights converted to bfloat16), the backward's weight gradients (the input shared) and the
input's gradient (a sum of two products). Each merge reads a concatenation that the ops making its
operands write instead of the operands, so each group must have operands made by such ops and read
by nothing else; the tests below check both the merges and the cases left alone. XLA copies such a
concatenation after writing its operands, so the region holding it must be ours. On by default
(JAXSTITCH_TUNE=merge_products=0 turns it off).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstitch
from jaxstitch.frontend import merged_products
from strategies import force_stitching, random_inputs
from test_recompute import _program

S = jax.ShapeDtypeStruct


def swiglu(x, wg, wu, wd):
    dt = x.dtype
    h = jax.nn.silu(x @ wg.astype(dt)) * (x @ wu.astype(dt))
    return h @ wd.astype(dt)


def swiglu_loss(x, wg, wu, wd):
    return jnp.sum(swiglu(x, wg, wu, wd).astype(jnp.float32) ** 2)


swiglu_grads = jax.grad(swiglu_loss, argnums=(0, 1, 2, 3))


def _specs(dtype):
    return [S((64, 32), dtype), S((32, 48), jnp.float32), S((32, 48), jnp.float32), S((48, 32), jnp.float32)]


ON = "merge_products=1"


def _traced(monkeypatch, fun, specs, tune=ON):
    return _program(monkeypatch, tune, fun, specs).traced


def _products(traced) -> int:
    return sum(op.prim == "dot_general" for op in traced.graph.ops)


def _merged(traced) -> int:
    return dict(traced.rewritten).get(merged_products.MERGED, 0)


def test_swiglu_backward_merges_three_groups(monkeypatch):
    traced = _traced(monkeypatch, swiglu_grads, _specs(jnp.bfloat16))
    assert _merged(traced) == 3
    assert _products(traced) == 9 - 3  # forward 3, backward 6 as written
    concats = [op for op in traced.graph.ops if op.prim == "concatenate"]
    # the weights [Wg | Wu] (read by the forward and by the input's gradient) and [dg | du]
    # (read by the weight gradients and the input's gradient): two, each written once
    assert sorted(op.outputs[0].shape for op in concats) == [(32, 96), (64, 96)]


def test_merge_products_is_on_by_default(monkeypatch):
    assert _merged(_traced(monkeypatch, swiglu_grads, _specs(jnp.bfloat16), tune="")) == 3


def test_merge_products_off_keeps_every_product(monkeypatch):
    traced = _traced(monkeypatch, swiglu_grads, _specs(jnp.bfloat16), tune="merge_products=0")
    assert _merged(traced) == 0
    assert _products(traced) == 9
    assert not any(op.prim == "concatenate" for op in traced.graph.ops)


def test_float32_weights_read_as_they_are_are_not_concatenated(monkeypatch):
    """In float32 the products read the weights themselves, program inputs that AdamW reads too: a
    concatenation would be a copy, so neither the sum nor the weight gradients merge."""
    traced = _traced(monkeypatch, swiglu_grads, _specs(jnp.float32))
    assert _merged(traced) == 0


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_merged_products_give_jax_jit_results(monkeypatch, dtype, tol):
    monkeypatch.setenv("JAXSTITCH_TUNE", ON)
    args = random_inputs(_specs(dtype), 3)
    with force_stitching():
        got = jaxstitch.jit(swiglu_grads, target="h100")(*args)
    want = jax.jit(swiglu_grads)(*args)
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        # bfloat16: the input's gradient is rounded once here and three times under jax.jit
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * np.abs(w).max())


def shared_operand(x, a, b, keep_a=False):
    pa, pb = jnp.sin(a), jnp.cos(b)
    outs = (x @ pa, x @ pb)
    return outs + ((pa,) if keep_a else ())


SHARED = [S((16, 8), jnp.float32), S((8, 12), jnp.float32), S((8, 12), jnp.float32)]


def _merges_like_jax_jit(monkeypatch, fun, specs, merged: int, seed: int):
    """`fun` traced with `merged` products merged, and its results, every region forced, jax.jit's."""
    assert _merged(_traced(monkeypatch, fun, specs)) == merged  # (JAXSTITCH_TUNE stays set below)
    args = random_inputs(specs, seed)
    with force_stitching():
        got = jaxstitch.jit(fun, target="h100")(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(fun)(*args))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_products_sharing_an_operand_merge_where_their_operands_are_made_for_them(monkeypatch):
    _merges_like_jax_jit(monkeypatch, shared_operand, SHARED, merged=1, seed=4)


def test_an_operand_read_elsewhere_is_not_concatenated(monkeypatch):
    traced = _traced(monkeypatch, lambda x, a, b: shared_operand(x, a, b, keep_a=True), SHARED)
    assert _merged(traced) == 0


def test_program_inputs_are_not_concatenated(monkeypatch):
    traced = _traced(monkeypatch, lambda x, a, b: (x @ a, x @ b), SHARED)
    assert _merged(traced) == 0


def test_a_product_reading_its_sibling_is_left_alone(monkeypatch):
    """The second product's operand is made from the first's result: one product of both would
    read its own result. Left as written (and the program still gives jax.jit's results)."""
    def chained(x, a):
        y = x @ jnp.sin(a)
        return y, x @ jnp.sin(y[:8, :12] + a)

    specs = [S((16, 8), jnp.float32), S((8, 12), jnp.float32)]
    _merges_like_jax_jit(monkeypatch, chained, specs, merged=0, seed=6)


def test_a_sum_with_other_terms_keeps_them(monkeypatch):
    def summed(x, y, p, q, z):
        return x @ jnp.sin(p) + z + y @ jnp.cos(q)

    specs = [S((16, 8), jnp.float32), S((16, 8), jnp.float32), S((8, 12), jnp.float32),
             S((8, 12), jnp.float32), S((16, 12), jnp.float32)]
    # x and y are program inputs: the sum merges only where both sides' operands are made for it
    assert _merged(_traced(monkeypatch, summed, specs)) == 0

    def made(x, y, p, q, z):
        return summed(jnp.tanh(x), jnp.exp(y), p, q, z)

    _merges_like_jax_jit(monkeypatch, made, specs, merged=1, seed=7)


def test_the_region_writing_a_merged_concatenation_is_ours(monkeypatch):
    """XLA would write dg and du and copy them: the estimate counts that copy, and the region that
    makes [dg | du] is stitched even though XLA would run the rest of it as one kernel."""
    specs = [S((4096, 768), jnp.bfloat16), S((768, 2048), jnp.float32), S((768, 2048), jnp.float32),
             S((2048, 768), jnp.float32)]
    program = _program(monkeypatch, ON, swiglu_grads, specs)

    def writes_dg_du(c):
        return any(op.prim == "concatenate" and op.outputs[0].shape == (4096, 4096) for op in c.plan.region.ops)

    (grads,) = [c for c in program.regions if writes_dg_du(c)]
    est = grads.plan.estimate
    assert grads.stitched, grads.reason
    assert est.xla_kernels == 2 and est.xla_bytes == est.bytes + 2 * 4096 * 4096 * 2


def test_explain_names_the_merge(monkeypatch):
    monkeypatch.setenv("JAXSTITCH_TUNE", ON)
    text = str(jaxstitch.explain(swiglu_grads, *_specs(jnp.bfloat16), target="h100"))
    assert "3 matrix products merged" in text
