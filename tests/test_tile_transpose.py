"""Transposes of the minor axis inside batches of small tiles (plan/tile.py): a tile is held in
shared memory by its two axes, so reading or writing it transposed costs no uncoalesced access;
so is a reshape merging a (transposed) tile's two axes into one, or splitting one into them.
Which regions become one tile kernel, the loop order of transposed stores, the reasons when a
transpose stays with XLA, and that every kernel NVRTC compiles. The GPU test of the same cases is
in test_gpu_correctness.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxstitch
from strategies import assert_same_as_jax_jit, random_inputs


def f32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def layernorm_transposed(x, g, b):  # features normalized, the result handed on as [B, D, T]
    xf = x.astype(jnp.float32)
    m = xf.mean(-1, keepdims=True)
    v = jnp.square(xf - m).mean(-1, keepdims=True)
    y = (xf - m) * jax.lax.rsqrt(v + 1e-5) * g + b
    return jnp.swapaxes(y, -1, -2).astype(x.dtype)


def softmax_of_transposed(x):  # a softmax over the steps of a [B, T, D] input
    return jax.nn.softmax(jnp.swapaxes(x, -1, -2).astype(jnp.float32), axis=-1).astype(x.dtype)


def both_orders(x, y):  # x [B, T, D] and y [B, D, T] meet, the output in x's order
    s = x.astype(jnp.float32) + jnp.swapaxes(y, -1, -2).astype(jnp.float32)
    return jax.nn.softmax(s, axis=1).astype(x.dtype)


def weighted_by_transposed_param(x, w):  # w [D, T] read transposed from global memory
    s = x.astype(jnp.float32) * jnp.swapaxes(w, 0, 1).astype(jnp.float32)
    return (s - s.max(-1, keepdims=True)).astype(x.dtype)


def heads_transposed_tiles(x):  # [B, H, T, D] -> [B, H, D, T] after a norm over D
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)
    return jnp.swapaxes(y, -1, -2).astype(x.dtype)


def scaled_transpose(x):  # nothing but a scaled transpose
    return jnp.swapaxes(x * 2, 1, 2)


def column_pair_sums(x):  # a row chain, then sums of column pairs: rows split into [B, C/2, 2]
    y = jax.nn.softmax(x.astype(jnp.float32), -1) * x.astype(jnp.float32)
    return jnp.sum(y.reshape(y.shape[0], -1, 2), axis=-1).astype(x.dtype)


def layernorm_transposed_flat(x, g, b):  # ... stored as [B, D * T]: a reshape that moves data
    return layernorm_transposed(x, g, b).reshape(x.shape[0], -1)


def softmax_of_flat_transposed(xf):  # [B, D * T] read as [B, D, T], transposed, softmax over D
    x = xf.reshape(xf.shape[0], 36, 50)
    return jax.nn.softmax(jnp.swapaxes(x, 1, 2).astype(jnp.float32), -1).astype(xf.dtype)


CASES = {  # name: (function, input specs)
    "layernorm_transposed": (layernorm_transposed, (f32(64, 50, 36), f32(36), f32(36))),
    "softmax_of_transposed": (softmax_of_transposed, (f32(64, 50, 36),)),
    "both_orders": (both_orders, (f32(48, 50, 36), f32(48, 36, 50))),
    "weighted_by_transposed_param": (weighted_by_transposed_param, (f32(40, 50, 36), f32(36, 50))),
    "heads_transposed_tiles": (heads_transposed_tiles, (f32(4, 6, 40, 24),)),
    "scaled_transpose": (scaled_transpose, (f32(32, 20, 24),)),
    "layernorm_transposed_flat": (layernorm_transposed_flat, (f32(64, 50, 36), f32(36), f32(36))),
    "softmax_of_flat_transposed": (softmax_of_flat_transposed, (f32(64, 1800),)),
}


def _moving(report):
    return [r for r in report.regions if {"transpose", "reshape"} & set(r.ops)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_transposed_tiles_are_one_tile_kernel_and_compile(name, monkeypatch):
    """Forced (any estimated gain): the transpose's region is one tile kernel, NVRTC compiles it."""
    monkeypatch.setenv("JAXSTITCH_TUNE", "min_gain_pct=0")
    fun, specs = CASES[name]
    report = jaxstitch.explain(fun, *specs, target="h100")
    moving = _moving(report)
    assert len(moving) == 1 and moving[0].stitched and moving[0].kernels == 1, report
    assert "tile" in moving[0].mapping, report


def test_transposed_stores_walk_a_fastest(tmp_path, monkeypatch):
    """A loop that stores only transposed tiles walks the tile's first axis fastest (contiguous in
    the output) and reads shared memory transposed; loads of a transposed input read it so too."""
    monkeypatch.setenv("JAXSTITCH_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("JAXSTITCH_TUNE", "min_gain_pct=0")
    jaxstitch.explain(layernorm_transposed, *CASES["layernorm_transposed"][1], target="h100")
    code = "\n".join(p.read_text() for p in tmp_path.rglob("*.cu"))
    assert "const int b = i / TA, a = i % TA;" in code
    assert "out0[((row) * TB + b) * TA + a]" in code


def test_a_transposed_input_is_read_transposed_in_shared_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSTITCH_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("JAXSTITCH_TUNE", "min_gain_pct=0")
    jaxstitch.explain(softmax_of_transposed, *CASES["softmax_of_transposed"][1], target="h100")
    code = "\n".join(p.read_text() for p in tmp_path.rglob("*.cu"))
    assert "sm0[b * TA + a]" in code


def test_square_tiles_meeting_their_transpose_are_left_to_xla_with_a_reason(monkeypatch):
    """Both axes of one length: values of the tile's shape are labelled a, b by default, and a
    transpose's result only through its operand. A square tile stored transposed is planned; one
    that meets its own transpose (x + x^T) gets conflicting labels and is left to XLA, never
    planned wrong."""
    monkeypatch.setenv("JAXSTITCH_TUNE", "min_gain_pct=0")
    report = jaxstitch.explain(layernorm_transposed, f32(64, 32, 32), f32(32), f32(32), target="h100")
    assert all(r.stitched for r in _moving(report)), report
    report = jaxstitch.explain(lambda x: jax.nn.softmax(x + jnp.swapaxes(x, 1, 2), -1), f32(64, 32, 32),
                               target="h100")
    moving = _moving(report)
    assert moving and not any(r.stitched for r in moving), report
    assert any("different tile axes" in (r.reason or "") for r in moving), report


def test_rows_split_into_tiles_alone_are_not_tiles(monkeypatch):
    """A reshape across a tile's axes is planned only with a transpose: rows merely split into
    [B, C/2, 2] are a row chain XLA runs as one kernel (as a tile kernel: 0.93x on an H100)."""
    monkeypatch.setenv("JAXSTITCH_TUNE", "min_gain_pct=0")
    report = jaxstitch.explain(column_pair_sums, f32(96, 1000), target="h100")
    assert not any("tile" in (r.mapping or "") for r in report.regions), report


def test_a_transposed_tile_stored_flat_counts_xla_as_one_kernel():
    """Stored [B, D * T], a layer norm's transposed result is one XLA kernel (measured): left to XLA."""
    report = jaxstitch.explain(layernorm_transposed_flat, f32(16384, 50, 36), f32(36), f32(36), target="h100")
    moving = _moving(report)
    assert moving and not any(r.stitched for r in moving) and moving[0].xla_kernels == 1, report
    stored_3d = jaxstitch.explain(layernorm_transposed, f32(16384, 50, 36), f32(36), f32(36), target="h100")
    assert all(r.stitched for r in _moving(stored_3d)), stored_3d


@pytest.mark.parametrize("name", ["layernorm_transposed", "both_orders"])
def test_fallback_matches_jax_jit(name):
    fun, specs = CASES[name]
    assert_same_as_jax_jit(fun, random_inputs(specs, 11))
