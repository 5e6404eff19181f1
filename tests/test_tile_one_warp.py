"""Tile kernels' row-scalar epochs (plan/tile._one_warp_epochs, lowering/tile_codegen): an epoch of
softmax statistics over a tile axis runs in the block's first warp alone when no later epoch reads
its registers, and row-scope loops over an axis of at most SLOTS * 32 elements keep the values they
compute in registers for the epoch's later loops. The GPU tests of the same kernels:
test_gpu_correctness.py::test_tile_kernels_match_xla (tiles of 20, 7, 50 and 150 rows)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jaxstitch.bench.workloads import WORKLOADS
from test_tile_vectors import _code, _dien_specs


def _epoch(code: str, n: int) -> str:
    return code[code.index(f"// epoch {n}"):code.index(f"// epoch {n + 1}")]


def stats_read_later(x):
    """A row max (a register) that the full-tile output reads in the next epoch."""
    s = jnp.sum(x, axis=2)
    m = jnp.max(s, axis=1, keepdims=True)
    p = jnp.exp(s - m)
    return x * p[..., None] * m[..., None], jnp.sum(x * p[..., None], axis=1)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dien_softmax_statistics_run_in_one_warp_computed_once(tmp_path, monkeypatch, dtype):
    code = _code(tmp_path, monkeypatch, WORKLOADS["dien_attention_fwdbwd"].fn, _dien_specs(dtype))
    stats = _epoch(code, 1)
    assert "// epoch 1: the first warp alone\n    if (warp == 0) {" in stats
    # 50 steps: two slots a lane; the max, the two sums and the map walk them in unrolled loops
    assert stats.count("for (int j = 0; j < 2; ++j) {") == 4
    assert stats.count("const int a = lane + 32 * j; if (a >= TA) continue;") == 4
    # the exponential (and the scaled score under the mask) once, kept in a slot array
    assert len(re.findall(r"v\d+_1\[j\] = (js_exp_fast|expf)\(", stats)) == 1
    assert len(re.findall(r"\b(js_exp_fast|expf)\(", stats)) == 1
    assert "BLOCK" not in stats  # no loop over the block's threads in a one-warp epoch
    for other in (0, 2, 3):
        assert "warp == 0" not in _epoch(code + "// epoch 4", other)


def test_registers_read_later_keep_every_warp(tmp_path, monkeypatch):
    sds = jax.ShapeDtypeStruct
    code = _code(tmp_path, monkeypatch, stats_read_later, (sds((64, 50, 36), jnp.float32),))
    stats = _epoch(code, 1)
    assert "warp == 0" not in code and "first warp alone" not in code
    assert "const int a = lane + 32 * j; if (a >= TA) continue;" in stats  # slots in the row step
    assert "for (int a = tid; a < TA; a += BLOCK)" in stats  # the map over the block's threads


def test_long_axes_walk_by_lanes_without_slots(tmp_path, monkeypatch):
    """150 steps: more than SLOTS (4) a lane, so each loop computes its values again."""
    code = _code(tmp_path, monkeypatch, WORKLOADS["dien_attention_fwdbwd"].fn,
                 _dien_specs(jnp.float32, b=64, t=150, d=24))
    stats = _epoch(code, 1)
    assert "if (warp == 0) {" in stats and "for (int j" not in stats
    assert stats.count("for (int a = lane; a < TA; a += 32) {") == 4


@pytest.mark.parametrize("dtype, d, pairs", [(jnp.bfloat16, 36, True), (jnp.float32, 36, False),
                                             (jnp.bfloat16, 35, False)])
def test_loops_along_b_take_pairs_of_half_precision_columns(tmp_path, monkeypatch, dtype, d, pairs):
    """Two consecutive b a step where a 2-byte input lies in shared memory and the width is even
    (a block on each tile; test_tile_teams.py has a warp's four)."""
    code = _code(tmp_path, monkeypatch, WORKLOADS["dien_attention_fwdbwd"].fn,
                 _dien_specs(dtype, b=16, t=50, d=d), "teams=1")
    along_b = "for (int b0 = 2 * (tid % GROUP); b0 < TB; b0 += 2 * GROUP)"
    along_a = "for (int t = tid; t < SLICES * (TB / 2); t += BLOCK) {"
    assert (along_b in code, along_a in code) == (pairs, pairs)
    assert ("for (int b = tid % GROUP; b < TB; b += GROUP)" in code) == (not pairs)


def test_dien_inputs_are_copied_ahead_as_vectors_at_the_tiles_start(tmp_path, monkeypatch):
    """float32 keys, 7200 bytes a tile: four 16-byte vectors a thread of 128, loaded and stored to
    the other stage buffer at once, before the wait for this tile's copies (no registers held across
    the tile); the query and the output gradient (144 bytes) likewise, the mask (50 bytes, not a
    multiple of 16) through registers stored at the tile's end."""
    code = _code(tmp_path, monkeypatch, WORKLOADS["dien_attention_fwdbwd"].fn, _dien_specs(jnp.float32))
    loop = code[code.index("for (long long row"):]
    top = loop[:loop.index("js_stage_wait<1>();")]
    assert re.search(r"for \(int k = 0; k < 4; \+\+k\) if \(js_more && tid \+ k \* BLOCK < 450\) "
                     r"reinterpret_cast<uint4\*>\(.*\)\[tid \+ k \* BLOCK\] = __ldg\(", top)
    assert top.count("< 9) reinterpret_cast<uint4*>(") == 2  # query, output gradient
    assert "js_block_copy_async" not in loop and "uint4 pf" not in loop
    assert "unsigned char pf" in top  # the mask


def test_large_tiles_keep_cp_async(tmp_path, monkeypatch):
    """A 9600-byte float32 tile would take 5 vectors a thread: cp.async (tile.MAX_VECTORS_PER_THREAD)."""
    code = _code(tmp_path, monkeypatch, WORKLOADS["dien_attention_fwdbwd"].fn,
                 _dien_specs(jnp.float32, b=16, t=60, d=40))
    loop = code[code.index("for (long long row"):]
    assert "if (js_more) js_block_copy_async<float, 2400, BLOCK>" in loop
