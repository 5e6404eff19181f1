"""The cost model's picture of XLA where CPU-only planning must use one (CPU: explain for an H200).

* XLA reduces a row in one kernel only up to its race-free bound (1024 threads x 16 elements): a
  longer row reduction is two kernels and no fusion hero, so a layer norm forward over 64 rows of
  262144 is several kernels (7, at 44% of the roofline, measured) and is stitched.
* A region that moves its bytes in about a microsecond is launch-bound: left to XLA unless XLA is
  estimated to need many kernels (measured: one XLA kernel of 1.2-2.7 us against ours at 1.4-3.5).
* XLA reduces along a tile's middle axis well where the kept minor axis fills its 32-wide
  column-reduction tiles: an attention pooling over 4096 x 100 x 64, one XLA kernel at 98% of the
  roofline, is left whole to XLA rather than cut into a stitched weighted sum beside XLA's softmax
  (measured 0.85x); DIEN's 36 features do not fill them, and its attention stays stitched.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxstitch
from jaxstitch.plan import cost

S = jax.ShapeDtypeStruct


def layernorm(x, g, b):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * g + b


def attention_pooling(q, k):
    """A softmax over the 50 steps of each row, then the steps summed weighted (DIEN's attention)."""
    p = jax.nn.softmax(jnp.sum(q[:, None, :] * k, -1), -1)
    return jnp.sum(p[..., None] * k, 1)


def _only(report):
    (region,) = report.regions
    return region


@pytest.mark.parametrize("cols", [262144, cost.XLA_RACE_FREE_ROW * 2])
def test_a_layer_norm_over_rows_longer_than_xlas_race_free_bound_is_stitched(cols):
    spec = S((64, cols), jnp.float32)
    region = _only(jaxstitch.explain(layernorm, spec, S((cols,), jnp.float32), S((cols,), jnp.float32), target="h200"))
    assert region.stitched, region.reason
    assert region.xla_kernels >= 5


def test_within_the_bound_xla_runs_the_layer_norm_as_one_kernel():
    spec = S((4096, 768), jnp.float32)
    region = _only(jaxstitch.explain(layernorm, spec, S((768,), jnp.float32), S((768,), jnp.float32), target="h200"))
    assert not region.stitched and region.xla_kernels == 1


@pytest.mark.parametrize("fn,specs", [
    (lambda x, dy: jax.vjp(lambda x: jax.nn.softmax(x, -1), x)[1](dy), [S((2, 128), jnp.float32)] * 2),
    (attention_pooling, [S((256, 36), jnp.float32), S((256, 50, 36), jnp.float32)]),
    (attention_pooling, [S((256, 36), jnp.bfloat16), S((256, 50, 36), jnp.bfloat16)]),
])
def test_launch_bound_regions_stay_with_xla(fn, specs):
    region = _only(jaxstitch.explain(fn, *specs, target="h200"))
    assert not region.stitched
    assert region.reason.startswith("launch-bound"), region.reason


def test_the_same_attention_at_scale_is_stitched():
    region = _only(jaxstitch.explain(attention_pooling, S((16384, 36), jnp.bfloat16), S((16384, 50, 36), jnp.bfloat16),
                                     target="h200"))
    assert region.stitched, region.reason


def weighted_pooling(s, v):
    """A softmax over the 100 scores of each row, then the 100 rows of 64 features summed weighted."""
    return jnp.sum(jax.nn.softmax(s, -1)[..., None] * v, 1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_pooling_xla_fuses_whole_is_not_cut(dtype):
    report = jaxstitch.explain(weighted_pooling, S((4096, 100), dtype), S((4096, 100, 64), dtype), target="h200")
    assert not any(r.stitched for r in report.regions), str(report)
