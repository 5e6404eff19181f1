"""Row inputs read only on a prefix of each row under a causal mask (plan/prefixes.py), on CPU,
planned for an H100: which inputs qualify, the offset and stride of each row's prefix, the stage
copies that skip the rest, the estimate, and jax.jit's results through the fallback."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstitch
from jaxstitch.core import config
from jaxstitch.driver import pipeline
from jaxstitch.lowering import codegen
from jaxstitch.plan.prefixes import Prefix
from strategies import force_stitching, random_inputs
from test_recompute import ATTENTION_SPECS, gpt_attention_grads

S = jax.ShapeDtypeStruct


def masked_softmax(x, window=None, strict=False, q_axis=-2):
    """A softmax over the last axis under a causal mask (k <= q, or k < q with `strict`; a sliding
    window of `window` keys), q the axis `q_axis` of x."""
    q = jax.lax.broadcasted_iota(jnp.int32, x.shape, q_axis % x.ndim)
    k = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    mask = k < q if strict else k <= q
    if window is not None:
        mask = jnp.logical_and(mask, k > q - window)
    scores = jnp.where(mask, x.astype(jnp.float32) * 0.125, -1e9)
    return jax.nn.softmax(scores, axis=-1).astype(x.dtype)


def summed_too(x):
    """The scores are also summed over the whole row: needed everywhere."""
    return masked_softmax(x), jnp.sum(x, axis=-1)


def suffix_mask(x):
    """k >= q: each row's end, not its start."""
    q = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 2)
    k = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jax.nn.softmax(jnp.where(k >= q, x, -1e9), axis=-1)


def _kernels(fun, specs):
    tree = jax.tree_util.tree_structure((tuple(specs), {}))
    with force_stitching():
        program = pipeline.build(fun, list(specs), tree, jaxstitch.get_target("h100"), config.load())
    return [c.plan.kernel for c in program.regions if c.stitched and c.plan.kernel is not None]


def _prefixes(fun, specs):
    return [p for k in _kernels(fun, specs) for p in k.prefixes]


SCORES = S((4, 6, 128, 128), jnp.bfloat16)


@pytest.mark.parametrize("kwargs, offset", [({}, 0), ({"strict": True}, -1), ({"window": 16}, 0)])
def test_a_causal_mask_reads_a_prefix_of_each_row(kwargs, offset):
    (p,) = _prefixes(lambda x: masked_softmax(x, **kwargs), [SCORES])
    assert (p.stride, p.size, p.offset) == (1, 128, offset)


def test_the_prefix_follows_the_q_axis_where_it_lies():
    """Scores laid out [b, q, h, k]: q counts every h rows."""
    (p,) = _prefixes(lambda x: masked_softmax(x, q_axis=1), [S((2, 128, 6, 128), jnp.float32)])
    assert (p.stride, p.size, p.offset) == (6, 128, 0)


@pytest.mark.parametrize("fun", [summed_too, suffix_mask])
def test_inputs_read_elsewhere_or_past_the_mask_are_read_whole(fun):
    assert _prefixes(fun, [SCORES]) == []


def test_the_attention_backward_reads_dp_whole():
    """The backward's exponentials come from the product's scores, under the mask; its `dp` is
    also summed over the row (sum(p * dp)), so only the scores qualify."""
    kernels = [k for k in _kernels(gpt_attention_grads, ATTENTION_SPECS) if any(op.prim == "exp" for op in k.region.ops)]
    assert len(kernels) == 2 and all(len(k.prefixes) == 1 for k in kernels), [k.prefixes for k in kernels]
    for k in kernels:
        (p,) = k.prefixes
        (v,) = [v for v in k.region.inputs if v.id == p.value]
        assert v.shape == (2, 4, 512, 512) and (p.stride, p.size, p.offset) == (1, 512, 0)


def test_kept_share_of_a_causal_square():
    assert Prefix(0, 1, 4, 0).kept(4) == 10 / 16  # rows keep 1, 2, 3 and 4 of 4 columns
    assert Prefix(0, 1, 4, -1).kept(4) == 6 / 16
    assert Prefix(0, 1, 4, 10).kept(4) == 1.0


def test_stage_copies_skip_past_the_prefix(monkeypatch):
    (k,) = _kernels(masked_softmax, [SCORES])
    source = codegen.render(k).code
    assert "const long long sext0 = (srow / 1) % 128 + 0;" in source
    assert "(ok && sc0 + col0 <= sext0)" in source
    monkeypatch.setenv("JAXSTITCH_TUNE", "prefixes=0")
    (k,) = _kernels(masked_softmax, [SCORES])
    assert not k.prefixes and "sext" not in codegen.render(k).code


def test_the_estimate_counts_the_skipped_bytes(monkeypatch):
    """Forced: without the skip, XLA's one kernel is as fast by the estimates (the region is then
    left to it); with it, ours reads a quarter fewer bytes."""
    specs = [S((8, 12, 512, 512), jnp.bfloat16)]
    on = jaxstitch.explain(masked_softmax, *specs, target="h100").regions
    assert [r.stitched for r in on] == [True]
    monkeypatch.setenv("JAXSTITCH_TUNE", "prefixes=0")
    assert [r.stitched for r in jaxstitch.explain(masked_softmax, *specs, target="h100").regions] == [False]
    with force_stitching():
        off = jaxstitch.explain(masked_softmax, *specs, target="h100").regions
    scores = 8 * 12 * 512 * 512 * 2
    assert off[0].est_bytes - on[0].est_bytes == int(scores * (1 - (512 * 513 / 2) / (512 * 512)))
    assert on[0].xla_est_us == off[0].xla_est_us  # (XLA reads the whole rows)


@pytest.mark.parametrize("fun", [masked_softmax, lambda x: masked_softmax(x, window=16, strict=True)])
def test_prefix_kernels_give_jax_jit_results(fun):
    args = random_inputs([S((2, 3, 64, 64), jnp.float32)], 11)
    with force_stitching():
        got = jaxstitch.jit(fun, target="h100")(*args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(fun)(*args)))
