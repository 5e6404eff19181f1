"""A warp on each tile (plan/tile.TILE_TEAMS, `teams`): a block of 128 threads works on four tiles at
once, each warp with its own shared memory, its epochs ending at the warp's barrier; only where
MIN_TEAM_WARPS such warps fit an SM (bfloat16 DIEN: 20; float32: 12, so a block takes each tile).
The GPU tests of the same kernels: test_gpu_correctness.py::test_tile_kernels_match_xla and
test_transposed_tiles_match_xla, with teams=1 and 4 (6000 of DIEN's tiles: several a warp)."""
from __future__ import annotations

import re

import jax.numpy as jnp
import pytest

import jaxstitch
from jaxstitch.plan import tile
from jaxstitch.core.config import Tuning
from jaxstitch.bench.workloads import WORKLOADS
from test_tile_vectors import _code, _dien_specs

DIEN = WORKLOADS["dien_attention_fwdbwd"].fn


def _region(monkeypatch, dtype, tune="", b=16384):
    """DIEN's one stitched region as explain reports it for an H100."""
    monkeypatch.setenv("JAXSTITCH_TUNE", tune)
    report = jaxstitch.explain(DIEN, *_dien_specs(dtype, b=b), target="h100")
    (region,) = [r for r in report.regions if r.stitched]
    return region


def test_bfloat16_tiles_take_a_warp_each_float32_a_block(monkeypatch):
    half = _region(monkeypatch, jnp.bfloat16)
    assert half.mapping.startswith("warp per 50x36 tile, 4 a block"), half.mapping
    assert half.block == 128 and half.grid <= (16384 + 3) // 4
    full = _region(monkeypatch, jnp.float32)
    assert full.mapping.startswith("block per 50x36 tile, 128 threads"), full.mapping
    forced = _region(monkeypatch, jnp.float32, "teams=4")
    assert forced.mapping.startswith("warp per 50x36 tile, 4 a block"), forced.mapping
    assert _region(monkeypatch, jnp.bfloat16, "teams=1").mapping.startswith("block per")


def test_a_warps_shared_memory_is_its_own_and_its_barriers_the_warps(tmp_path, monkeypatch):
    code = _code(tmp_path, monkeypatch, DIEN, _dien_specs(jnp.bfloat16), "teams=4")
    assert "#define TEAMS 4" in code and "#define BLOCK 32" in code
    team_smem = int(re.search(r"#define TEAM_SMEM (\d+)", code).group(1))
    assert team_smem % 16 == 0
    assert "js_dyn = js_smem + js_team * TEAM_SMEM" in code
    assert "__launch_bounds__(BLOCK * TEAMS," in code
    kernel = code[code.index('extern "C"'):]
    assert "__syncthreads" not in kernel
    assert kernel.count("JS_TILE_SYNC();") == 2 + 3  # the tile's start and end, and 3 epoch ends
    assert "row += js_stride" in kernel and "js_next = row + js_stride" in kernel


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_copies_ahead_cover_each_input_with_a_warps_threads(tmp_path, monkeypatch, dtype):
    """The next tile's inputs copied through registers or as vectors: a thread's share of each is
    counted by the tile's 32 threads, not the block's 128 (the query's 36 elements and the mask's 50
    need two a thread; counted by the block's, elements 32 on were never copied)."""
    code = _code(tmp_path, monkeypatch, DIEN, _dien_specs(dtype), "teams=4")
    loops = re.findall(r"for \(int k = 0; k < (\d+); \+\+k\) if \(js_more && tid \+ k \* BLOCK < (\d+)\)", code)
    assert loops
    for trips, count in loops:
        assert int(trips) * 32 >= int(count), (trips, count)


def test_a_warps_loops_read_rows_and_columns_as_vectors(tmp_path, monkeypatch):
    """bfloat16 DIEN on a warp: the scores' loop walks a row of keys 4 at a time (one 8-byte read,
    the float query and output gradient 16 bytes each); the key gradient's loop takes 3 rows of 9
    threads at once, b fixed in each thread, so the query and output gradient are read once before
    it."""
    code = _code(tmp_path, monkeypatch, DIEN, _dien_specs(jnp.bfloat16), "teams=4")
    assert "if (a < TA) for (int b0 = 0; b0 < TB; b0 += 4) {" in code
    assert re.search(r"js_load<js_bf16, 4>\(sm(\d+) \+ a \* TB \+ b0, js_p\1\);", code)
    each = code[code.index("const int b0 = (tid % 9) * 4, s = tid / 9;  // the same b in every step"):]
    head, loop = each.split("for (int a = tid < 27 ? s : TA; a < TA; a += SLICES) {", 1)
    assert len(re.findall(r"js_load<float, 4>\(sm\d+ \+ b0, js_p\d+\);", head)) == 2
    loop = loop[:loop.index("js_store<js_bf16, 4>")]
    assert "js_p" in loop and "sm1[b]" not in loop and "sm3[b]" not in loop


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_warps_key_gradient_and_sums_over_a_are_one_loop(tmp_path, monkeypatch, dtype):
    """plan/tile._each_along_a: on a warp, DIEN's key gradient (stored whole) and its two sums over the
    50 steps walk the tile once: 3 slices of 9 threads, 4 b a thread, each folding the keys it reads
    into its b's accumulators; a block on each tile keeps the two loops."""
    plan = _tile_plan(dtype, "teams=4")
    loops = [s.loop for s in plan.steps if s.epoch == 2]
    assert tile.EACH_ALONG_A in loops and tile.ALONG_A not in loops and tile.EACH not in loops, loops
    (merged,) = [s for s in plan.steps if s.loop == tile.EACH_ALONG_A]
    assert len(merged.ops) == 2 and len(merged.stores) == 1 and plan.mapping.slices == 3
    code = _code(tmp_path, monkeypatch, DIEN, _dien_specs(dtype), "teams=4")
    loop = code[code.index("for (int a = tid < 27 ? s : TA; a < TA; a += SLICES) {"):]
    loop = loop[:loop.index("JS_TILE_SYNC();")]
    assert len(re.findall(r"js_load<\w+, 4>\(sm0 \+ a \* TB \+ b0, js_p0\);", loop)) == 1, loop
    assert loop.count("js_store<") == 1 and loop.count("[s * TB + b0 + u] = acc") == 2, loop
    assert "for (int t = tid; t < SLICES" not in code
    block = [s.loop for s in _tile_plan(dtype, "teams=1").steps]
    assert tile.EACH_ALONG_A not in block and tile.ALONG_A in block and tile.EACH in block


def test_a_block_on_each_tile_reads_element_by_element(tmp_path, monkeypatch):
    """The vector reads are a warp's (by measurement: a block's float32 tile ran 9% slower)."""
    code = _code(tmp_path, monkeypatch, DIEN, _dien_specs(jnp.float32), "teams=1")
    assert not re.search(r"js_p\d+\[", code) and "#define TEAMS 1" in code


@pytest.mark.parametrize("ta, tb, pairs, want", [(50, 36, True, 3), (50, 36, False, 5), (7, 200, False, 1)])
def test_slices_of_a_warp_fill_its_lanes(ta, tb, pairs, want):
    """DIEN's 18 pairs of columns: 3 slices (2 rounds of 32 lanes, 17 rows each) rather than 1 (18
    lanes busy for 50 rows)."""
    assert tile.team_slices(ta, tb, pairs) == want


def test_teams_tuning_is_checked():
    assert Tuning.parse("teams=4").teams == 4
    with pytest.raises(ValueError, match="teams=3"):
        Tuning.parse("teams=3")


def test_a_grid_of_warps_tiles_counts_blocks_of_four(monkeypatch):
    """Blocks of four tiles: 600 tiles take 150 blocks; 16384 take one wave of them."""
    assert _region(monkeypatch, jnp.bfloat16, b=600).grid == 150
    assert _region(monkeypatch, jnp.bfloat16).grid < 16384 // 4


def _tile_plan(dtype, tune=""):
    """DIEN's tile plan (the stitched region's) as pipeline.build makes it for an H100."""
    import jax

    from jaxstitch.core import config
    from jaxstitch.driver import pipeline
    from jaxstitch import targets
    specs = list(_dien_specs(dtype, b=16384))
    tree = jax.tree_util.tree_structure((tuple(specs), {}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXSTITCH_TUNE", tune)
        program = pipeline.build(DIEN, specs, tree, targets.get_target("h100"), config.load())
    (c,) = [c for c in program.regions if c.stitched]
    return c.plan.kernel


@pytest.mark.parametrize("dtype, tune", [(jnp.bfloat16, ""), (jnp.bfloat16, "teams=1"), (jnp.float32, "")])
def test_arrays_share_shared_memory_only_across_barriers(dtype, tune):
    """plan/tile._share_shared_memory: arrays and partials whose epochs (write to last read) meet
    never share a byte; some that do not meet do (bfloat16 DIEN on a warp: 10176 -> 9344 bytes a
    tile, six blocks of four warps an SM)."""
    plan = _tile_plan(dtype, tune)
    steps = list(plan.steps)
    producer = {op.outputs[0].id: op for op in plan.region.ops}
    reads = tile._read_epochs(steps, {t.value.id: t for t in plan.values}, producer, plan.root)
    spans = []
    for t in plan.values:
        if t.home == tile.ARRAY:
            first = t.array_epoch - 1
            last = max([e for e in reads.get(t.value.id, ()) if e >= t.array_epoch], default=first)
            n = 4 * (plan.mapping.tile_a if t.domain == tile.A else plan.mapping.tile_b)
            spans.append((first, last, t.offset, n))
        if t.partial_offset >= 0:
            first = t.array_epoch - 2 if t.home == tile.ARRAY else t.epoch - 1
            n = 4 * (plan.mapping.slices * plan.mapping.tile_b if t.domain == tile.B else plan.mapping.team // 32)
            spans.append((first, first + 1, t.partial_offset, n))
    shared = 0
    for i, (f1, l1, o1, n1) in enumerate(spans):
        assert o1 >= 2 * plan.mapping.stage_bytes and o1 + n1 <= plan.mapping.team_smem
        for f2, l2, o2, n2 in spans[i + 1:]:
            apart = o1 + n1 <= o2 or o2 + n2 <= o1
            assert apart or l1 < f2 or l2 < f1, ((f1, l1, o1, n1), (f2, l2, o2, n2))
            shared += not apart
    assert shared > 0
    if dtype == jnp.bfloat16 and not tune:
        assert plan.mapping.team_smem == 9344 and plan.mapping.smem_bytes == 4 * 9344


def test_teams_whose_shared_memory_no_block_may_have_are_declined(monkeypatch):
    """Eight 100x40 float32 tiles (34 KB each) would need 273 KB a block: forced, the region is left
    to XLA with the reason; by default the plan takes a block a tile."""
    specs = _dien_specs(jnp.float32, b=512, t=100, d=40)
    monkeypatch.setenv("JAXSTITCH_TUNE", "teams=8,min_gain_pct=0")
    report = jaxstitch.explain(DIEN, *specs, target="h100")
    assert not any(r.stitched for r in report.regions)
    assert "a block may have" in str(report), str(report)
    monkeypatch.setenv("JAXSTITCH_TUNE", "min_gain_pct=0")
    (region,) = [r for r in jaxstitch.explain(DIEN, *specs, target="h100").regions if r.stitched]
    assert region.mapping.startswith("block per 100x40 tile")


def test_the_report_says_why_a_block_takes_each_float32_tile(monkeypatch):
    region = _region(monkeypatch, jnp.float32)
    assert region.alternatives == (
        "warp per 50x36 tile, 4 a block (16384 bytes of shared memory a tile): 12 warps an SM, fewer than 16",), \
        region.alternatives
    assert _region(monkeypatch, jnp.bfloat16).alternatives == ()
