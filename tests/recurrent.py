"""Recurrent scans for the persistent-scan tests (plan/scan.py): a DIEN-like GRU cell, its gradient,
and scans whose bodies do or do not keep batch rows apart. Shared by the CPU and GPU tests."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxstitch.bench.workloads import dien_gru


# DIEN's GRU over time: the input projection `gx` [T, B, 3H] made outside, the recurrent product and
# gates in the body; masked steps keep the state. Returns every step's state [T, B, H].
gru = dien_gru


def gru_reverse(kernel, h0, gx, mask):
    return gru(kernel, h0, gx, mask, reverse=True)


def gru_grad(kernel, h0, gx, mask):
    """The gradient of a loss over the states: a forward scan saving residuals, and a reverse scan
    whose carry sums the recurrent weight's gradient over rows and steps."""
    def loss(kernel, h0, gx):
        s = gru(kernel, h0, gx, mask)
        return jnp.sum(s.astype(jnp.float32) ** 2) + jnp.sum(jnp.sin(s[-1].astype(jnp.float32)))
    return jax.grad(loss, argnums=(0, 1, 2))(kernel, h0, gx)


def running_mean(x):
    """A scan with no batch axis: a scalar carry over [T] steps (one block runs it)."""
    def step(c, xt):
        c = 0.9 * c + 0.1 * xt
        return c, c * 2.0
    return lax.scan(step, jnp.zeros((), x.dtype), x)


def bias_sum(w, xs):
    """A carry that adds a sum over rows each step (a bias gradient accumulated over time), next to
    a batched carry."""
    def step(carry, x):
        h, acc = carry
        h = jnp.tanh(x + h @ w)
        return (h, acc + jnp.sum(h * x, axis=0)), h
    (h, acc), ys = lax.scan(step, (jnp.ones(xs.shape[1:], xs.dtype), jnp.zeros(xs.shape[-1:], xs.dtype)), xs)
    return h, acc, ys


def row_softmax_over_batch(w, xs):
    """Mixes rows (a softmax over the batch axis each step): no batch axis, so one block runs it."""
    def step(h, x):
        h = jax.nn.softmax(x + h @ w, axis=0)
        return h, h
    return lax.scan(step, jnp.zeros(xs.shape[1:], xs.dtype), xs)[1]


def gru_inputs(batch, hidden=36, steps=50, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    kernel = rng.standard_normal((hidden, 3 * hidden)).astype(np.float32) * 0.3
    h0 = rng.standard_normal((batch, hidden)).astype(np.float32)
    gx = rng.standard_normal((steps, batch, 3 * hidden)).astype(np.float32)
    lengths = rng.integers(1, steps + 1, size=batch)
    mask = (np.arange(steps)[:, None] < lengths[None])[..., None]
    return [jnp.asarray(kernel, dtype), jnp.asarray(h0, dtype), jnp.asarray(gx, dtype), jnp.asarray(mask)]


def dense_inputs(batch, width, steps, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((width, width)).astype(np.float32) / np.sqrt(width)
    xs = rng.standard_normal((steps, batch, width)).astype(np.float32)
    return [jnp.asarray(w, dtype), jnp.asarray(xs, dtype)]


def greedy_decode(w, xs):
    """An argmax each step (a greedy decoder's pick): not a primitive a scan kernel holds, so the
    scan stays an XLA loop."""
    def step(h, x):
        h = jnp.tanh(x + h @ w)
        return h, jnp.argmax(h, axis=-1)
    return lax.scan(step, jnp.zeros(xs.shape[1:], xs.dtype), xs)


def second_order(w, xs):
    """A carry that takes another carry's value (h2 <- h1): copied in place one after the other,
    h1 would already hold the new value, so the scan stays an XLA loop."""
    def step(carry, x):
        h1, h2 = carry
        h = jnp.tanh(x + h1 @ w - 0.5 * h2)
        return (h, h1), h
    init = (jnp.zeros(xs.shape[1:], xs.dtype), jnp.zeros(xs.shape[1:], xs.dtype))
    return lax.scan(step, init, xs)


def features_first(w, xs):
    """States held [H, B] (the batch on the second axis): w @ h, a product with the weights on the
    left."""
    def step(h, x):
        h = jnp.tanh(w @ h + x)
        return h, h
    return lax.scan(step, jnp.ones(xs.shape[1:], xs.dtype), xs)


def normalized_cell(w, xs):
    """A cell normalizing its state over the features each step (a mean and a variance per row,
    broadcast back: reductions along a non-batch axis)."""
    def step(h, x):
        a = jnp.tanh(x + h @ w)
        mean = a.mean(-1, keepdims=True)
        var = ((a - mean) ** 2).mean(-1, keepdims=True)
        h = (a - mean) * lax.rsqrt(var + 1e-5)
        return h, mean[:, 0]
    return lax.scan(step, jnp.zeros(xs.shape[1:], xs.dtype), xs)


def two_axis_product(w, xs):
    """A state [B, 4, 9] contracted over two axes with weights [4, 9, 36], reshaped back: a product
    with two contracting dimensions, and reshapes that keep rows apart."""
    def step(h, x):
        z = jnp.einsum("bij,ijk->bk", h, w)
        h = jnp.tanh(z.reshape(h.shape) + x)
        return h, z
    return lax.scan(step, jnp.zeros(xs.shape[1:], xs.dtype), xs)


def _weights_and_steps(wshape, xshape, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(wshape).astype(np.float32) / np.sqrt(np.prod(wshape[:-1]))
    return [jnp.asarray(w), jnp.asarray(rng.standard_normal(xshape).astype(np.float32))]


# name: (function, inputs, whether every scan is planned as one kernel)
CASES = {
    "gru_fwd": (gru, lambda: gru_inputs(256), True),
    "gru_grad": (gru_grad, lambda: gru_inputs(256), True),
    "gru_grad_37_rows": (gru_grad, lambda: gru_inputs(37, seed=1), True),
    "gru_grad_301_rows": (gru_grad, lambda: gru_inputs(301, seed=2), True),
    "gru_reverse": (gru_reverse, lambda: gru_inputs(100, steps=20, seed=3), True),
    "gru_grad_bf16": (gru_grad, lambda: gru_inputs(128, steps=16, dtype=jnp.bfloat16, seed=4), True),
    "running_mean": (running_mean, lambda: [jnp.asarray(np.random.default_rng(5).standard_normal(64), jnp.float32)], True),
    "bias_sum": (bias_sum, lambda: dense_inputs(200, 16, 30, seed=6), True),
    "row_softmax_over_batch": (row_softmax_over_batch, lambda: dense_inputs(64, 8, 10, seed=7), True),
    "greedy_decode": (greedy_decode, lambda: dense_inputs(32, 16, 12, seed=8), False),
    "second_order": (second_order, lambda: dense_inputs(32, 16, 12, seed=10), False),
    "features_first": (features_first, lambda: _weights_and_steps((24, 24), (15, 24, 200), 11), True),
    "normalized_cell": (normalized_cell, lambda: dense_inputs(150, 32, 20, seed=12), True),
    "two_axis_product": (two_axis_product, lambda: _weights_and_steps((4, 9, 36), (10, 70, 4, 9), 13), True),
}
