"""Which row reductions XLA fuses with the ops reading their result back (plan/diamonds.py), and what
the cost model makes of the ones it does not."""
import jax
import jax.numpy as jnp
import pytest

import jaxstitch
from jaxstitch.graph import partition as partition_mod
from jaxstitch.driver import pipeline
from jaxstitch.frontend import trace as trace_mod
from jaxstitch.plan import diamonds
from jaxstitch.bench.workloads import causal_softmax_bwd  # GPT's: masked again and scaled
from test_views import causal_softmax


def f32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def softmax_bwd(y, dy):
    """A softmax's backward from its saved probabilities, as attention's gradient runs it."""
    return y * (dy - jnp.sum(dy * y, axis=-1, keepdims=True))


def layernorm(x):
    m = x.mean(-1, keepdims=True)
    xc = x - m
    return xc * jax.lax.rsqrt((xc * xc).mean(-1, keepdims=True) + 1e-5)


def scaled_by_sum(x):
    """The broadcast sum as the first operand of a commutative op: taken as XLA's diamond."""
    return jnp.sum(x, axis=-1, keepdims=True) * x


def mean_read_twice(x):
    """One reduction broadcast to two ops: not a diamond (its broadcast has two readers)."""
    m = x.mean(-1, keepdims=True)
    return (x - m) * (x / m)


def row_sums(x):
    """A reduction whose result is never read back over the row."""
    return jnp.sum(jnp.exp(x), axis=-1)


def _region(fun, specs):
    flat, tree = jax.tree_util.tree_flatten((tuple(specs), {}))
    traced = trace_mod.trace(fun, flat, tree)
    (region,) = partition_mod.partition(traced.graph, fits=lambda r: pipeline._fits_one_kernel(r, jaxstitch.TARGETS["h100"])).regions
    return region


@pytest.mark.parametrize("fun, unfused", [
    (jax.nn.softmax, 0), (layernorm, 0), (scaled_by_sum, 0), (row_sums, 0), (causal_softmax, 0),
    (softmax_bwd, 1), (causal_softmax_bwd, 1), (mean_read_twice, 1),
])
def test_reductions_xla_cannot_fuse_with_their_readers(fun, unfused):
    specs = [f32(64, 128)] * (2 if "bwd" in fun.__name__ else 1)
    if fun in (causal_softmax, causal_softmax_bwd):
        specs = [f32(2, 3, 128, 128)] * len(specs)
    assert diamonds.unfused_reductions(_region(fun, specs)) == unfused


@pytest.mark.parametrize("fun", [softmax_bwd, causal_softmax_bwd])
def test_a_softmax_backward_is_two_xla_kernels_and_stitched(fun):
    """Measured on an H100 (scripts/softmax_probe.py), GPT's shape, float32: XLA 165.6 us in two
    kernels, ours 101.5 us. The cost model left it to XLA as one kernel before."""
    (r,) = jaxstitch.explain(fun, f32(8, 12, 512, 512), f32(8, 12, 512, 512), target="h100").regions
    assert r.stitched and r.kernels == 1, r.reason
    assert r.xla_kernels == 2
    assert 1.3 < r.xla_est_us / r.est_us < 1.8, (r.est_us, r.xla_est_us)


def test_a_softmax_forward_stays_one_xla_kernel():
    (r,) = jaxstitch.explain(jax.nn.softmax, f32(4096, 1024), target="h100").regions
    assert not r.stitched and r.xla_kernels == 1, r


def _gelu_layernorm(approximate):
    def fun(x):
        return layernorm(jax.nn.gelu(x.astype(jnp.float32), approximate=approximate)).astype(x.dtype)
    return fun


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_an_exact_gelu_before_a_layernorm_is_stitched_for_xlas_slow_erfc(dtype):
    """XLA runs a layernorm as one Triton kernel, and its erfc there adds to the loads' time. Measured
    on an H100 (scripts/transcendental_probe.py, [32768, 2048], float32 / bfloat16): XLA 663 / 487 us,
    ours forced 193 / 106. The tanh GELU (XLA 228 / 142, ours 191 / 102) and the layernorm alone
    (181 / 94 against 190 / 96) stay XLA's: the model counts no tanh (the target's calibration.xla_triton_slow_ns)."""
    x = jax.ShapeDtypeStruct((32768, 2048), dtype)
    (r,) = jaxstitch.explain(_gelu_layernorm(False), x, target="h100").regions
    assert r.stitched and r.xla_kernels == 1, r.reason
    assert 2.5 < r.xla_est_us / r.est_us < 5.5, (r.est_us, r.xla_est_us)
    for fun in (_gelu_layernorm(True), layernorm):
        (r,) = jaxstitch.explain(fun, x, target="h100").regions
        assert not r.stitched and r.xla_kernels == 1, r


def test_a_slow_op_costs_xla_nothing_more_without_a_row_read_back():
    """Only a row reduction read back over the row makes XLA's Triton kernel; a plain row sum of an
    erfc is estimated as one of an exp."""
    x = f32(32768, 2048)
    erfc, exp = (jaxstitch.explain(lambda x, f=f: jnp.sum(f(x), axis=-1), x, target="h100").regions[0]
                 for f in (jax.lax.erfc, jnp.exp))
    assert erfc.xla_est_us == exp.xla_est_us
