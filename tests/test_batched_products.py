"""Batched products' minor-axis transposes folded into them (batched_products.py), on CPU.

Autodiff and `jnp.einsum` write an attention's value gradient as a product whose result, and one of
whose operands, are transposed along the minor axis: no region of ours reads those and XLA runs
each as a transposing kernel. Folded, the product writes the order the transpose asked for up to a
permutation of the major axes, which a region reads in place; the results are the same.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstitch
from jaxstitch.frontend import batched_products, merged_products, trace
from strategies import random_inputs

S = jax.ShapeDtypeStruct
B, T, H, D = 2, 16, 3, 8


def attention(q, k, v):
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(D)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def attention_loss(q, k, v):
    return jnp.sum(jnp.tanh(attention(q, k, v)) ** 2)


attention_grads = jax.grad(attention_loss, argnums=(0, 1, 2))
QKV = [S((B, T, H, D), jnp.float32)] * 3


def _minor_transposes(eqns) -> int:
    """Transposes that move the minor axis of a product's result or of a product's operand."""
    made_by = {o.id: e for e in eqns for o in e.outputs}
    read_by = {}
    for e in eqns:
        for a in e.inputs:
            if hasattr(a, "id"):
                read_by.setdefault(a.id, []).append(e.primitive.name)
    n = 0
    for e in eqns:
        if e.primitive.name != "transpose" or e.params["permutation"][-1] == len(e.params["permutation"]) - 1:
            continue
        src = made_by.get(e.inputs[0].id)
        from_product = src is not None and src.primitive.name == "dot_general"
        n += from_product or "dot_general" in read_by.get(e.outputs[0].id, [])
    return n


def _fold(fun, specs, seed: int, which: int = batched_products.EVERY):
    """`fun`'s equations folded, how many, and whether they give what the equations as traced do."""
    traced = trace.trace(fun, specs, trace.positional_tree(specs))
    ids = iter(range(10**6, 2 * 10**6))
    eqns, n = batched_products.fold_batched(traced.eqns, traced.graph.outputs,
                                            lambda shape, dtype: trace.ir.Value(next(ids), shape, dtype), which)
    args = random_inputs(specs, seed)
    ins, outs = traced.graph.inputs, traced.graph.outputs
    got = trace.evaluate(eqns, ins, args, outs, traced.consts)
    for g, w in zip(got, trace.evaluate(traced.eqns, ins, args, outs, traced.consts)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    return traced.eqns, eqns, n


def test_an_attentions_gradients_lose_their_minor_axis_transposes():
    before, after, n = _fold(attention_grads, QKV, 3)
    assert _minor_transposes(before) >= 2
    assert n >= 2 and _minor_transposes(after) == 0


def test_the_forward_attention_output_is_written_with_its_minor_axis_last():
    before, after, n = _fold(attention, QKV, 4)
    assert n == _minor_transposes(before) and _minor_transposes(after) == 0


def test_an_operand_transpose_is_folded_only_where_the_free_axes_keep_their_order():
    def kept(x, y):  # x^T's free axis (d) is one axis: folded
        return jnp.einsum("bhds,bhsk->bhdk", jnp.transpose(x, (0, 2, 3, 1)), y)

    assert _fold(kept, [S((B, T, H, D), jnp.float32), S((B, H, T, 5), jnp.float32)], 5)[2] == 1

    def reordered(x, y):  # x^T's free axes (d, c) come out swapped against x's: left alone
        return jnp.einsum("bdcs,bsk->bdck", jnp.transpose(x, (0, 3, 2, 1)), y)

    assert _fold(reordered, [S((B, T, 4, D), jnp.float32), S((B, T, 5), jnp.float32)], 6)[2] == 0


def test_the_default_folds_only_what_an_op_computes_with():
    """batched_folds=1 (OPENING): a product's transpose is folded where an op that computes reads
    it (BERT's bias gradient of the attention output, a column sum), not where only a product or a
    data-moving op reads it (GPT's output projection, its rotary backward's slices), which XLA fuses
    with the transpose either way."""
    w = S((H * D, 4), jnp.float32)

    def projected(q, k, v, w):
        return attention(q, k, v).reshape(B, T, H * D) @ w

    def sliced(q, k, v):
        return jnp.concatenate([attention(q, k, v)[..., : D // 2] * 2.0, attention(q, k, v)[..., D // 2:]], -1)

    def bias_grad(q, k, v, w):
        out = attention(q, k, v).reshape(B, T, H * D)
        return out @ w, jnp.sum(out, axis=(0, 1))

    opening = batched_products.OPENING
    assert _fold(projected, QKV + [w], 12)[2] >= 1 and _fold(projected, QKV + [w], 12, opening)[2] == 0
    assert _fold(sliced, QKV, 13, opening)[2] == 0
    assert _fold(bias_grad, QKV + [w], 14, opening)[2] == 1


def test_unbatched_and_shared_products_are_left_alone():
    def unbatched(x, w):
        return jnp.transpose(x @ w, (1, 0))

    assert _fold(unbatched, [S((16, 24), jnp.float32), S((24, 32), jnp.float32)], 7)[2] == 0

    def read_twice(a, b):
        y = jnp.einsum("bij,bjk->bik", a, b)
        return y, jnp.swapaxes(y, 1, 2)

    assert _fold(read_twice, [S((4, 8, 16), jnp.float32), S((4, 16, 12), jnp.float32)], 8)[2] == 0


def _marked(fun, specs) -> list[tuple[int, ...]]:
    traced = trace.trace(fun, specs, trace.positional_tree(specs))
    eqns, _ = merged_products.mark_product_concatenations(traced.eqns, traced.graph.outputs)
    return [e.outputs[0].shape for e in eqns if e.primitive.name == "concatenate" and e.for_products]


def test_concatenations_only_products_read_are_marked():
    def projected(a, b, w):
        return jnp.concatenate([a, b], axis=-1).reshape(-1, 2 * D) @ w

    specs = [S((B, T, D), jnp.float32)] * 2 + [S((2 * D, 4), jnp.float32)]
    assert _marked(projected, specs) == [(B, T, 2 * D)]

    def also_summed(a, b, w):
        c = jnp.concatenate([a, b], axis=-1)
        return c.reshape(-1, 2 * D) @ w, jnp.sum(c)

    assert _marked(also_summed, specs) == []


@pytest.mark.parametrize("tune", ["batched_folds=2", "batched_folds=2,product_concats=1"])
def test_knobs_give_jax_jit_results(monkeypatch, tune):
    monkeypatch.setenv("JAXSTITCH_TUNE", tune)
    args = random_inputs(QKV, 11)
    want = jax.jit(attention_grads)(*args)
    got = jaxstitch.jit(attention_grads)(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)
    assert "batched products reordered" in str(jaxstitch.explain(attention_grads, *QKV, target="h100"))


def rotary(x):
    """GPT's rotary embedding (examples/gpt_train.py) at positions 0..T-1, base 10000."""
    half = x.shape[-1] // 2
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * 10000.0 ** (-jnp.arange(half) / half)
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def rotary_attention_loss(x, w):
    """GPT's attention block up to its output: one q/k/v projection, rotary queries and keys."""
    b, t, c = x.shape  # (w scaled so the scores are O(1): a saturated softmax is ill-conditioned)
    q, k, v = jnp.split((x @ (w * c ** -0.5).astype(x.dtype)).reshape(b, t, 3 * H, c // H), 3, axis=2)
    out = attention(rotary(q), rotary(k), v)
    return jnp.sum(jnp.tanh(out.astype(jnp.float32)) ** 2)


rotary_attention_grads = jax.grad(rotary_attention_loss, argnums=(0, 1))


def rotary_specs(dtype, b: int = B, t: int = T, c: int = H * D):
    return [S((b, t, c), dtype), S((c, 3 * c), jnp.float32)]


def bias_attention_loss(x, w, b):
    """BERT's attention block up to its output: a q/k/v projection with biases, no rotary."""
    n, t, c = x.shape
    qkv = x @ (w * c ** -0.5).astype(x.dtype) + b.astype(x.dtype)
    q, k, v = jnp.split(qkv.reshape(n, t, 3 * H, c // H), 3, axis=2)
    return jnp.sum(jnp.tanh(attention(q, k, v).astype(jnp.float32)) ** 2)


bias_attention_grads = jax.grad(bias_attention_loss, argnums=(0, 1, 2))


def bias_specs(dtype, b: int = B, t: int = T, c: int = H * D):
    return rotary_specs(dtype, b, t, c) + [S((3 * c,), jnp.float32)]


def test_bias_gradients_open_the_default_folds(monkeypatch):
    """The q/k/v biases' gradients (column sums of dq, dk, dv) read the attention backward's
    products through their transposes: batched_folds=1 (the default) folds the one an op computes
    with, and its region can be planned (no longer a transpose of the minor axis); with
    batched_folds=0 nothing is folded."""
    specs = bias_specs(jnp.float32, 8, 128, 3 * 64)
    rep = jaxstitch.explain(bias_attention_grads, *specs, target="h100")
    assert "batched products reordered" in str(rep)
    monkeypatch.setenv("JAXSTITCH_TUNE", "batched_folds=0")
    off = jaxstitch.explain(bias_attention_grads, *specs, target="h100")
    assert "batched products reordered" not in str(off)

    def transposing(report):
        return sum("walks its minor axis" in (r.reason or "") for r in report.regions)
    assert transposing(rep) < transposing(off), (str(rep), str(off))


def _rotary_backward(report):
    """The region concatenating the rotary backward's dq and dk with dv, GPT's head size."""
    (cat,) = [r for r in report.regions
              if "concatenate" in r.ops and "add_any" in r.ops and (r.rows, r.cols) == (8 * 512 * 3 * H, 64)]
    return cat


def test_the_rotary_backward_concatenation_is_ours(monkeypatch):
    """With both knobs, the rotary backward's dq/dk/dv concatenation the q/k/v projection's products
    read is planned as ours, reading the products' results and the rotary tables through views
    (with this machine's NVRTC; the GPU machines' needed 168 registers for it and declined it while
    it still computed the tables itself); with the folds alone it
    stays XLA's, one kernel of the same bytes."""
    monkeypatch.setenv("JAXSTITCH_TUNE", "batched_folds=2,product_concats=1")
    specs = rotary_specs(jnp.bfloat16, 8, 512, 3 * 64)
    rep = jaxstitch.explain(rotary_attention_grads, *specs, target="h100")
    cat = _rotary_backward(rep)
    assert cat.stitched and cat.xla_kernels == 2, cat
    assert not {"pow", "cos", "sin"} & set(cat.ops), cat.ops
    monkeypatch.setenv("JAXSTITCH_TUNE", "batched_folds=2")
    rep = jaxstitch.explain(rotary_attention_grads, *specs, target="h100")
    cat = _rotary_backward(rep)
    assert not cat.stitched and "one kernel" in cat.reason
