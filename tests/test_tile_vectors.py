"""Whole-tile loops of tile kernels (plan/tile.py) that store full tiles in (n, a, b) order take
several consecutive b a thread and store them as one vector (lowering/tile_codegen._store_width);
odd widths and transposed stores keep one element a thread. The GPU tests of the same kernels:
test_gpu_correctness.py (tiles of 12, 200 and 36 columns, DIEN's attention)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import jaxstitch
from jaxstitch.bench.workloads import WORKLOADS
from test_tile_transpose import CASES, layernorm_transposed


def _dien_specs(dtype, b=64, t=50, d=36):
    sds = jax.ShapeDtypeStruct
    return (sds((b, t, d), dtype), sds((b, d), dtype), sds((b, t), jnp.bool_), sds((b, d), dtype))


def _code(tmp_path, monkeypatch, fun, specs, tune: str = "") -> str:
    """The generated CUDA of `fun` planned for an H100 (JAXSTITCH_TUNE `tune`, e.g. "teams=1": a
    block on each tile, where the plan would give bfloat16 DIEN tiles a warp each)."""
    monkeypatch.setenv("JAXSTITCH_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("JAXSTITCH_TUNE", ",".join(filter(None, ["min_gain_pct=0", tune])))
    report = jaxstitch.explain(fun, *specs, target="h100")
    assert any(r.stitched and "tile" in (r.mapping or "") for r in report.regions), report
    return "\n".join(p.read_text() for p in tmp_path.rglob("*.cu"))


@pytest.mark.parametrize("dtype, width", [(jnp.bfloat16, 4), (jnp.float32, 4)])
def test_dien_attention_stores_its_key_gradient_in_vectors(tmp_path, monkeypatch, dtype, width):
    """36 columns: 4 a vector (8 would not divide 36); bfloat16 8 bytes, float32 16 (a block on each
    tile: test_tile_teams.py has a warp's loop)."""
    code = _code(tmp_path, monkeypatch, WORKLOADS["dien_attention_fwdbwd"].fn, _dien_specs(dtype), "teams=1")
    assert f"for (int i0 = tid * {width}; i0 < TILE; i0 += BLOCK * {width})" in code
    store = "js_bf16" if dtype == jnp.bfloat16 else "float"
    assert re.search(rf"js_store<{store}, {width}>\(out(\d+) \+ \(row\) \* TILE \+ i0, js_v\1\);", code)


def test_half_precision_tiles_round_once_and_read_their_vectors_as_floats(tmp_path, monkeypatch):
    """bfloat16 DIEN: the key gradient is stored from its float (the store rounds; no js_round_bf16
    before it), and the query and output gradient, copied through registers, lie in shared memory
    as floats, converted as they are stored there (71.1 -> 66 us on an H100). A block
    on each tile."""
    code = _code(tmp_path, monkeypatch, WORKLOADS["dien_attention_fwdbwd"].fn, _dien_specs(jnp.bfloat16),
                 "teams=1")
    each = code[code.index("for (int i0 = tid * 4"):]
    each = each[:each.index("js_store<js_bf16, 4>")]
    assert "js_round_bf16" not in each
    wide = re.findall(r"const float\* sm(\d+) = reinterpret_cast<float\*>", code)
    assert len(wide) == 2, wide  # query and output gradient; the keys stay bfloat16 (copied as vectors)
    for vid in wide:
        assert f"js_io<js_bf16>::get(sm{vid}[" not in code and f"sm{vid}[b]" in code
    assert code.count("js_block_copy_wide<js_bf16, 36, BLOCK>") == 2
    assert re.search(r"const js_bf16\* sm\d+ = reinterpret_cast<js_bf16\*>", code)  # the keys


def test_wide_half_precision_tiles_take_sixteen_bytes(tmp_path, monkeypatch):
    code = _code(tmp_path, monkeypatch, WORKLOADS["dien_attention_fwdbwd"].fn,
                 _dien_specs(jnp.bfloat16, b=16, t=7, d=200))
    assert re.search(r"js_store<js_bf16, 8>\(out\d+ ", code)


def test_odd_widths_and_transposed_stores_keep_one_element_a_thread(tmp_path, monkeypatch):
    odd = _code(tmp_path / "odd", monkeypatch, WORKLOADS["dien_attention_fwdbwd"].fn,
                _dien_specs(jnp.float32, b=16, t=50, d=35))
    assert "for (int i = tid; i < TILE; i += BLOCK)" in odd and "i0" not in odd
    transposed = _code(tmp_path / "t", monkeypatch, layernorm_transposed, CASES["layernorm_transposed"][1])
    assert "const int b = i / TA, a = i % TA;" in transposed and "i0" not in transposed
