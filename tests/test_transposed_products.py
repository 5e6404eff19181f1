"""Transposed matrix products written as the swapped product (transposed_products.py), on CPU.

Autodiff writes a weight's gradient as a product followed by a transpose into the weight's layout.
In a program whose products merged_products.py merges, the transpose is folded into the product
before partitioning; only where the product has no batch axes, the transpose swaps its operands'
free axes and nothing else reads the product. Where nothing merges the program stays as written.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxstitch
from jaxstitch.frontend import trace, transposed_products
from strategies import random_inputs
from test_merged_products import _specs as swiglu_specs, _traced, swiglu_grads

S = jax.ShapeDtypeStruct


def _folded(traced) -> int:
    return dict(traced.rewritten).get(transposed_products.FOLDED, 0)


def _transposed_products(eqns) -> int:
    made_by = {o.id: e.primitive.name for e in eqns for o in e.outputs}
    return sum(e.primitive.name == "transpose" and made_by.get(e.inputs[0].id) == "dot_general" for e in eqns)


def test_a_merged_programs_weight_gradients_are_written_in_the_weights_layout(monkeypatch):
    as_written = _traced(monkeypatch, swiglu_grads, swiglu_specs(jnp.bfloat16), tune="merge_products=0")
    assert _transposed_products(as_written.eqns) == 3  # dWg, dWu, dWd
    traced = _traced(monkeypatch, swiglu_grads, swiglu_specs(jnp.bfloat16), tune="")
    assert _folded(traced) == 3 and _transposed_products(traced.eqns) == 0
    (dwd,) = [op for op in traced.graph.ops if op.prim == "dot_general" and op.outputs[0].shape == (48, 32)]
    assert [a.shape for a in dwd.inputs] == [(64, 48), (64, 32)]  # h first, then the cotangent


def dense_loss(x, w):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


dense_grads = jax.grad(dense_loss, argnums=(0, 1))
DENSE = [S((8, 16, 24), jnp.float32), S((24, 32), jnp.float32)]


def test_nothing_folds_where_nothing_merges(monkeypatch):
    traced = _traced(monkeypatch, dense_grads, DENSE, tune="")
    assert _folded(traced) == 0 and _transposed_products(traced.eqns) == 1


def _fold(fun, specs, seed: int):
    """`fun`'s equations folded, how many, and whether they give what the equations as traced do."""
    traced = trace.trace(fun, specs, trace.positional_tree(specs))
    eqns, n = transposed_products.fold_transposes(traced.eqns, traced.graph.outputs)
    args = random_inputs(specs, seed)
    ins, outs = traced.graph.inputs, traced.graph.outputs
    got = trace.evaluate(eqns, ins, args, outs, traced.consts)
    for g, w in zip(got, trace.evaluate(traced.eqns, ins, args, outs, traced.consts)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    return eqns, n


def test_folded_products_compute_the_same():
    eqns, n = _fold(dense_grads, DENSE, 9)
    assert n == 1 and _transposed_products(eqns) == 0


def test_a_product_read_elsewhere_keeps_its_transpose():
    def both(x, w):
        y = x @ w
        return y, y.T

    eqns, n = _fold(both, [S((16, 24), jnp.float32), S((24, 32), jnp.float32)], 10)
    assert n == 0 and _transposed_products(eqns) == 1


def test_batched_products_and_other_permutations_are_left_alone():
    def batched(a, b):
        return jnp.swapaxes(jnp.einsum("bij,bjk->bik", a, b), 1, 2)

    assert _fold(batched, [S((4, 8, 16), jnp.float32), S((4, 16, 12), jnp.float32)], 11)[1] == 0

    def partly(x, w):  # (8, 16, 32) -> (16, 8, 32): the lhs's own axes swapped, not the operands
        return jnp.transpose(x @ w, (1, 0, 2))

    assert _fold(partly, DENSE, 12)[1] == 0

    def swapped(x, w):  # (8, 16, 32) -> (32, 8, 16): the operands' free axes swapped, each in order
        return jnp.transpose(x @ w, (2, 0, 1))

    assert _fold(swapped, DENSE, 13)[1] == 1


def test_explain_names_the_fold(monkeypatch):
    monkeypatch.delenv("JAXSTITCH_TUNE", raising=False)
    text = str(jaxstitch.explain(swiglu_grads, *swiglu_specs(jnp.bfloat16), target="h100"))
    assert "3 transposed products folded" in text
