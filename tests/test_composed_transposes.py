"""Transposes of transposes composed in the trace (jaxstitch/frontend/composed_transposes.py), as XLA's
simplifier composes them: the pair that undoes itself vanishes, another reads the first operand once,
and every program computes what jax.jit computes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstitch
from strategies import force_stitching

S = jax.ShapeDtypeStruct


def undone(x, w):
    return jnp.tanh(jnp.swapaxes(jnp.swapaxes(x, 1, 2), 1, 2)) @ w


def composed(x, w):
    return jnp.tanh(jnp.transpose(jnp.transpose(x, (1, 0, 2)), (0, 2, 1))) * 2.0


def shared(x, w):  # (the first transpose has another reader, and a composed one is returned)
    t = jnp.swapaxes(x, 0, 1)
    return jnp.swapaxes(t, 0, 1) + 1.0, t * 3.0, jnp.transpose(t, (2, 0, 1))


@pytest.mark.parametrize("fn, rewritten", [(undone, 1), (composed, 1), (shared, 2)])
def test_composed_transposes_match_jax_jit(fn, rewritten):
    x = jax.random.normal(jax.random.key(0), (8, 64, 32))
    w = jax.random.normal(jax.random.key(1), (32, 32))
    report = jaxstitch.explain(fn, x, w, target="h200")
    assert dict(report.rewritten).get("transposes of transposes composed") == rewritten
    with force_stitching():
        got = jaxstitch.jit(fn, target="h200")(x, w)
    for g, want in zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(fn)(x, w)), strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)


def test_a_pair_that_undoes_itself_leaves_no_transpose_to_plan():
    report = jaxstitch.explain(undone, S((8, 512, 64), jnp.float32), S((64, 64), jnp.float32), target="h200")
    assert [r.ops for r in report.regions] == [("tanh",)]
