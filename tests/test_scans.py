"""Scans along rows (cumsum, cumprod, cummax, cummin; forward and reverse) inside stitched regions:
which regions hold them, the mappings that carry them, the reasons when they are left to XLA, and that
every kernel NVRTC compiles. The GPU test of the same cases is in test_gpu_correctness.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxstitch
from strategies import assert_same_as_jax_jit, random_inputs
from jaxstitch.core import ops as opdefs
from jaxstitch.bench.workloads import survival_fwdbwd, top_p_filter


def f32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def position_ids(x):  # a padding mask's running count, as serving stacks number tokens
    mask = x > -0.5
    return jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, jnp.sum(mask, axis=-1)


def reverse_exp(x):
    return lax.cumsum(jnp.exp(x), axis=1, reverse=True) * 0.5


def running_max_gap(x):  # a drawdown: how far each value is below the running max
    return lax.cummax(x, axis=1) - x


def reverse_cummin(x):
    return lax.cummin(x, axis=1, reverse=True) + x


def growth(x):
    return lax.cumprod(1.0 + 0.01 * x, axis=1)


def cumsum_3d(x):  # rows over two leading axes
    return jnp.cumsum(jnp.tanh(x), axis=-1)


def bf16_cumsum(x):  # the scan in the input's precision, as written
    return jnp.cumsum(x.astype(jnp.bfloat16), axis=-1).astype(jnp.float32)


def scan_grad(x):  # a forward scan and, in the backward pass, a reverse one: one kernel
    return jax.grad(lambda x: jnp.sum(jnp.cumsum(x, -1) ** 2))(x)


CASES = {  # name: (function, input specs, what the mapping must say or None)
    "top_p": (top_p_filter, (f32(64, 4096),), "block per row"),
    "top_p_chunked": (top_p_filter, (f32(40, 32000),), "chunks"),
    "survival_fwdbwd": (survival_fwdbwd, (f32(256, 512), f32(256, 512)), "warp per row"),
    "position_ids": (position_ids, (f32(300, 200),), None),
    "reverse_exp": (reverse_exp, (f32(100, 24),), "rows per warp"),
    "running_max_gap_chunked": (running_max_gap, (f32(5, 40000),), "chunks"),
    "reverse_cummin_chunked": (reverse_cummin, (f32(3, 50001),), "chunks"),
    "growth": (growth, (f32(300, 1000),), None),
    "cumsum_3d": (cumsum_3d, (f32(8, 16, 128),), None),
    "bf16_cumsum": (bf16_cumsum, (f32(128, 2048),), None),
    "scan_grad": (scan_grad, (f32(200, 384),), None),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_scans_stitch_into_one_kernel_and_compile(name, monkeypatch):
    """Forced (any estimated gain): the scan's region is one kernel, NVRTC compiles it."""
    monkeypatch.setenv("JAXSTITCH_TUNE", "min_gain_pct=0")
    fun, specs, mapping = CASES[name]
    report = jaxstitch.explain(fun, *specs, target="h100")
    scanning = [r for r in report.regions if set(r.ops) & opdefs.SCANS]
    assert len(scanning) == 1 and scanning[0].stitched, report
    assert scanning[0].kernels == 1
    if mapping:
        assert mapping in scanning[0].mapping, report


def test_top_p_filter_is_one_kernel():
    report = jaxstitch.explain(top_p_filter, f32(2048, 32000), target="h100")
    assert len(report.regions) == 1 and report.regions[0].kernels == 1, report
    assert "cumsum" in report.regions[0].ops


def test_a_scan_along_a_leading_axis_is_left_to_xla():
    report = jaxstitch.explain(lambda x: jnp.cumsum(jnp.exp(x), axis=0), f32(64, 32), target="h100")
    assert "cumsum along axis 0 of (64, 32), not the last" in str(report), report


def test_scans_both_ways_over_chunked_rows_are_left_to_xla_with_the_reason():
    report = jaxstitch.explain(scan_grad, f32(8, 65536), target="h100")
    assert any("scans in both directions" in (r.reason or "") for r in report.regions), report


def test_scans_are_not_split_over_blocks():
    """Few long rows split over blocks elsewhere; a scan's carry needs its row in one block."""
    softmax = jaxstitch.explain(lambda x: jax.nn.softmax(x, -1), f32(8, 262144), target="h100")
    assert "split" in softmax.regions[0].mapping, softmax
    report = jaxstitch.explain(lambda x: jnp.cumsum(jax.nn.softmax(x, -1), -1), f32(8, 262144), target="h100")
    assert "split" not in (report.regions[0].mapping or ""), report


def test_kernel_walks_chunks_backwards_for_a_reverse_scan(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSTITCH_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("JAXSTITCH_TUNE", "min_gain_pct=0")
    jaxstitch.explain(reverse_cummin, f32(3, 50001), target="h100")
    code = "\n".join(p.read_text() for p in tmp_path.rglob("*.cu"))
    assert "for (int ch = CHUNKS - 1; ch >= 0; --ch)" in code
    assert "for (int ch = 0; ch < CHUNKS; ++ch)" not in code


@pytest.mark.parametrize("name", ["top_p", "survival_fwdbwd", "position_ids", "scan_grad"])
def test_fallback_matches_jax_jit(name):
    fun, specs, _ = CASES[name]
    assert_same_as_jax_jit(fun, random_inputs(specs, 3))


def test_a_chunked_row_alone_on_its_sm_gives_way_to_fewer_threads():
    """Top-p over 32k float32 logits spills at 512 threads a row within the launch bounds' cap; with
    the cap lifted it fits one block an SM, so 256 threads a row (within the cap) is taken."""
    report = jaxstitch.explain(top_p_filter, f32(2048, 32000), target="h100")
    region = report.regions[0]
    assert region.stitched and "8 chunks" in region.mapping, report
    assert any("one block of 512 per SM" in t for t in region.alternatives), report
