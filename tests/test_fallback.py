"""An internal error is a logged fallback to XLA, never a crash and never a wrong result (CPU).

The test session runs with JAXSTITCH_STRICT=1 (conftest.py); these tests unset it to see what a
user sees: the region (or the program) left to XLA, jax.jit's results, one warning.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstitch
from jaxstitch.driver import fallback, pipeline
from jaxstitch.integration import families
from jaxstitch.kernels import cache, nvrtc


def _norm(x, g):
    m = jnp.mean(x, axis=-1, keepdims=True)
    v = jnp.mean((x - m) ** 2, axis=-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * g


def layernorm(x, g):
    """A layer norm's gradients: one region the cost model stitches."""
    return jax.grad(lambda x, g: jnp.sum(_norm(x, g) * x), argnums=(0, 1))(x, g)


@pytest.fixture
def lenient(monkeypatch):
    monkeypatch.delenv("JAXSTITCH_STRICT", raising=False)
    fallback._SAID.clear()


def _args():
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.standard_normal((2048, 1024)), jnp.float32), jnp.asarray(rng.standard_normal(1024), jnp.float32)


def _same_as_jit(fn, args):
    got, want = jaxstitch.jit(fn, target="h100")(*args), jax.jit(fn)(*args)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_a_planning_error_leaves_its_region_to_xla_with_one_warning(lenient, monkeypatch, caplog):
    def broken(region, target, cfg):
        raise KeyError("a planner bug")
    monkeypatch.setattr(pipeline, "compile_region", broken)
    with caplog.at_level(logging.WARNING, logger="jaxstitch"):
        _same_as_jit(layernorm, _args())
        report = jaxstitch.explain(layernorm, *_args(), target="h100")
    assert not any(r.stitched for r in report.regions)
    assert all("internal error in planning: KeyError" in r.reason for r in report.regions)
    said = [r for r in caplog.records if "internal error" in r.getMessage()]
    assert len(said) == 1  # (once, though planned twice)
    assert "reduce_sum" in said[0].getMessage() and "test_fallback.py" in said[0].getMessage(), said[0].getMessage()


def test_an_nvrtc_error_leaves_its_region_to_xla(lenient, monkeypatch, caplog):
    def failing(*args, **kwargs):
        raise nvrtc.CompileError("kernel.cu(1): error: something in our source")
    monkeypatch.setattr(cache, "get_cubin", failing)
    with caplog.at_level(logging.WARNING, logger="jaxstitch"):
        _same_as_jit(layernorm, _args())
    assert any("internal error in NVRTC" in r.getMessage() for r in caplog.records)


def test_a_program_level_error_runs_the_program_as_jax_jit(lenient, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("a partitioning bug")
    monkeypatch.setattr(families, "build_any", broken)
    with caplog.at_level(logging.WARNING, logger="jaxstitch"):
        _same_as_jit(layernorm, _args())
    assert any("runs as jax.jit after an internal error" in r.getMessage() and "layernorm" in r.getMessage()
               for r in caplog.records)


def test_strict_raises_the_internal_error(monkeypatch):
    monkeypatch.setenv("JAXSTITCH_STRICT", "1")
    monkeypatch.setattr(pipeline, "compile_region", lambda *a: (_ for _ in ()).throw(KeyError("a planner bug")))
    with pytest.raises(KeyError, match="a planner bug"):
        jaxstitch.jit(layernorm, target="h100")(*_args())


def test_the_users_own_error_is_raised_as_it_is(lenient):
    def wrong(x, g):
        raise ValueError("the user's mistake")
    with pytest.raises(ValueError, match="the user's mistake"):
        jaxstitch.jit(wrong, target="h100")(*_args())


def test_a_refusal_met_while_rendering_is_a_reason_not_an_internal_error(monkeypatch, caplog):
    """A plan/ helper that rendering calls (layout.row_axes, a view's affine map) may still refuse:
    the region stays XLA's with that reason, quietly and under JAXSTITCH_STRICT too; only codegen's
    own Unrenderable is a bug (warned about)."""
    from jaxstitch.core import config
    from jaxstitch.lowering import codegen
    from jaxstitch.plan.layout import ReasonKind, Unplannable

    def refusing(kernel):
        raise Unplannable(ReasonKind.LAYOUT, "shape (3, 5) does not split into 4 rows")

    monkeypatch.setattr(codegen, "render", refusing)
    x, g = (jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _args())
    region = next(r for r in pipeline.build(layernorm, [x, g], jax.tree_util.tree_structure(((x, g), {})),
                                            jaxstitch.get_target("h100"), config.load()).partition.regions)
    with caplog.at_level(logging.WARNING, logger="jaxstitch"):
        c = pipeline.compile_region(region, jaxstitch.get_target("h100"), config.load())
    assert not c.stitched and c.error == "codegen: shape (3, 5) does not split into 4 rows"
    assert not [r for r in caplog.records if "internal error" in r.getMessage()]
