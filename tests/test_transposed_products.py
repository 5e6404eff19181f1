"""Transposed matrix products written as the swapped product (transposed_products.py), on CPU.

Autodiff writes a weight's gradient as a product followed by a transpose into the weight's layout.
With merge_products=1 the transpose is folded into the product before partitioning; only where the
product has no batch axes, the transpose swaps its operands' free axes and nothing else reads the
product.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstitch
from jaxstitch import transposed_products
from strategies import force_stitching, random_inputs
from test_recompute import _program

S = jax.ShapeDtypeStruct
ON = "merge_products=1"


def _traced(monkeypatch, fun, specs, tune=ON):
    return _program(monkeypatch, tune, fun, specs).traced


def _folded(traced) -> int:
    return dict(traced.rewritten).get(transposed_products.FOLDED, 0)


def _transposed_products(traced) -> int:
    made_by = {o.id: op.prim for op in traced.graph.ops for o in op.outputs}
    return sum(op.prim == "transpose" and made_by.get(op.inputs[0].id) == "dot_general"
               for op in traced.graph.ops)


def dense_loss(x, w):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


dense_grads = jax.grad(dense_loss, argnums=(0, 1))
DENSE = [S((8, 16, 24), jnp.float32), S((24, 32), jnp.float32)]


def test_a_weight_gradient_is_written_in_the_weights_layout(monkeypatch):
    assert _transposed_products(_traced(monkeypatch, dense_grads, DENSE, tune="")) == 1  # as autodiff wrote it
    traced = _traced(monkeypatch, dense_grads, DENSE)
    assert _folded(traced) == 1
    assert _transposed_products(traced) == 0
    (dw,) = [op for op in traced.graph.ops if op.prim == "dot_general" and op.outputs[0].shape == (24, 32)]
    assert [a.shape for a in dw.inputs] == [(8, 16, 24), (8, 16, 32)]  # x first, then the cotangent


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_folded_products_give_jax_jit_results(monkeypatch, dtype, tol):
    monkeypatch.setenv("JAXSTITCH_TUNE", ON)
    specs = [S(s.shape, dtype) for s in DENSE]
    args = random_inputs(specs, 9)
    with force_stitching():
        got = jaxstitch.jit(dense_grads, target="h100")(*args)
    for g, w in zip(got, jax.jit(dense_grads)(*args)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * np.abs(w).max())


def test_a_product_read_elsewhere_keeps_its_transpose(monkeypatch):
    def both(x, w):
        y = x @ w
        return y, y.T

    traced = _traced(monkeypatch, both, [S((16, 24), jnp.float32), S((24, 32), jnp.float32)])
    assert _folded(traced) == 0 and _transposed_products(traced) == 1


def test_batched_products_and_other_permutations_are_left_alone(monkeypatch):
    def batched(a, b):
        return jnp.swapaxes(jnp.einsum("bij,bjk->bik", a, b), 1, 2)

    specs = [S((4, 8, 16), jnp.float32), S((4, 16, 12), jnp.float32)]
    assert _folded(_traced(monkeypatch, batched, specs)) == 0

    def partly(x, w):  # (8, 16, 32) -> (16, 8, 32): the lhs's own axes swapped, not the operands
        return jnp.transpose(x @ w, (1, 0, 2))

    traced = _traced(monkeypatch, partly, DENSE)
    assert _folded(traced) == 0 and _transposed_products(traced) == 1

    def swapped(x, w):  # (8, 16, 32) -> (32, 8, 16): the operands' free axes swapped, each in order
        return jnp.transpose(x @ w, (2, 0, 1))

    assert _folded(_traced(monkeypatch, swapped, DENSE)) == 1
    args = random_inputs(DENSE, 10)
    with force_stitching():
        got = jaxstitch.jit(swapped, target="h100")(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(swapped)(*args)), rtol=1e-5, atol=1e-5)


def test_off_by_default(monkeypatch):
    assert _folded(_traced(monkeypatch, dense_grads, DENSE, tune="")) == 0


def test_explain_names_the_fold(monkeypatch):
    monkeypatch.setenv("JAXSTITCH_TUNE", ON)
    text = str(jaxstitch.explain(dense_grads, *DENSE, target="h100"))
    assert "1 transposed products folded" in text
