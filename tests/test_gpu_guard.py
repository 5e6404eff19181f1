"""The program guard on a GPU (jaxstitch/integration/guard.py): it keeps a stitched program that is faster than
jax.jit's and replaces one that is slower, and either way the results are jax.jit's within the
tolerances, on fresh inputs with our outputs poisoned."""
import jax
import jax.numpy as jnp
import pytest

import jaxstitch
from jaxstitch.integration import guard
from jaxstitch.bench.workloads import WORKLOADS
from strategies import force_stitching
from test_gpu_correctness import compare

pytestmark = pytest.mark.gpu


def row_sums_of_exp(x):
    return jnp.sum(jnp.exp(x) * 2.0, axis=-1)


def test_a_slower_stitched_program_is_replaced_by_jax_jits(monkeypatch):
    """One thread a row over 1024 rows of 8192 (JAXSTITCH_TUNE=max_tpr=1, the cost model's veto
    lifted): estimated 208 us against XLA's 13 us on an H200."""
    monkeypatch.setenv("JAXSTITCH_TUNE", "max_tpr=1")
    monkeypatch.setenv("JAXSTITCH_POISON", "1")
    with force_stitching():
        f = jaxstitch.jit(row_sums_of_exp, guard=True)
        x = jax.random.normal(jax.random.key(0), (1024, 8192))
        compare(f(x), jax.jit(row_sums_of_exp)(x), "first call (stitched)")
    (d,) = f.guard_decisions
    assert d.choice == guard.XLA and d.stitched_ms > 2 * d.xla_ms, d
    y = jax.random.normal(jax.random.key(1), (1024, 8192))
    compare(f(y), jax.jit(row_sums_of_exp)(y), "a later call (jax.jit's)")
    assert len(f.guard_decisions) == 1


def test_a_faster_stitched_program_is_kept():
    """layernorm_fwdbwd in bfloat16: 3.98x jax.jit's (H100, the suite's shape)."""
    w = WORKLOADS["layernorm_fwdbwd"]
    f = jaxstitch.jit(w.fn, guard=True)
    for seed in (0, 1):
        args = list(w.draw(jax.random.key(seed), jnp.bfloat16, *w.full_shape))
        for got, want in zip(jax.tree.leaves(f(*args)), jax.tree.leaves(jax.jit(w.fn)(*args)), strict=True):
            compare(got, want, f"layernorm_fwdbwd, seed {seed}")
    (d,) = f.guard_decisions
    assert d.choice == guard.STITCHED and d.stitched_ms < d.xla_ms, d
