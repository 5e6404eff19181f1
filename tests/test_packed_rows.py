"""Rows several to a warp (horizontal packing): the register budget they hold elements in
(mapping.choose), the ordered fold of a variadic reduce's or argmax's elements within a thread
(lowering/reductions.combiner's `later`), and the row loop without a barrier where only the
threads' own stage slots live in shared memory (codegen). The GPU tests of the same kernels:
test_gpu_correctness.py::test_variadic_reduces_match_xla and the random graphs (argmax)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import jaxstitch
from jaxstitch.bench.workloads import WORKLOADS, moe_router, top1_pair
from test_variadic import argmax_with_value, argmin_with_value

sds = jax.ShapeDtypeStruct


def _code(tmp_path, monkeypatch, fun, *specs) -> str:
    monkeypatch.setenv("JAXSTITCH_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("JAXSTITCH_TUNE", "min_gain_pct=0")
    jaxstitch.explain(fun, *specs, target="h100")
    return "\n".join(p.read_text() for p in sorted(tmp_path.rglob("*.cu")))


def _define(code: str, name: str) -> int:
    return int(re.search(rf"#define {name} (\d+)", code).group(1))


@pytest.mark.parametrize("dtype, vec, tpr", [(jnp.bfloat16, 8, 4), (jnp.float32, 4, 4)])
def test_moe_router_holds_16_elements_a_thread(tmp_path, monkeypatch, dtype, vec, tpr):
    """Five arrays held (the logits, two column means, two for temporaries): 16 elements each fit
    the 85 registers the launch bounds leave; 64 alone would allow 8. The column means' float32
    results do not narrow a bfloat16 row's vectors."""
    code = _code(tmp_path, monkeypatch, moe_router, sds((1 << 20, 64), dtype))
    assert (_define(code, "V"), _define(code, "TPR")) == (vec, tpr)
    assert _define(code, "V") * _define(code, "VPT") == 16


def test_a_packed_layernorm_backward_keeps_8_elements(tmp_path, monkeypatch):
    """Seven arrays held: 16 elements each would be 112 registers, past the cap."""
    w = WORKLOADS["layernorm_fwdbwd_short"]
    specs = [sds(a.shape, a.dtype) for a in w.make_inputs(jax.random.key(0), jnp.dtype("float32"), False)]
    code = _code(tmp_path, monkeypatch, w.fn, *specs)
    assert _define(code, "V") * _define(code, "VPT") == 8 and _define(code, "TPR") == 8


def test_index_comparisons_fold_for_a_threads_later_elements(tmp_path, monkeypatch):
    """top1_pair's tie-break `b_index < a_index` is false for an element after the partials'; the
    first element of a chunk folds with the combiner as written (the initial index may be larger)."""
    code = _code(tmp_path, monkeypatch, moe_router, sds((4096, 64), jnp.float32))
    name = re.search(r"void (js_comb\d+)_later\(", code).group(1)
    later = code[code.index(f"void {name}_later("):]
    later = later[:later.index("}")]
    assert "(b1 < a1)" not in later and "= false;" in later and "(b0 > a0)" in later
    assert re.search(rf"if \(e == 0\) {name}\(p\d+, p\d+, [^;]*\); else {name}_later\(", code)
    # lanes' partials still combine with the combiner as written (their indices are in any order)
    assert f"if (lane & o) {{ {name}(" in code


def test_argmin_with_an_int_max_start_keeps_the_first_fold_whole(tmp_path, monkeypatch):
    code = _code(tmp_path, monkeypatch, argmin_with_value, sds((4096, 24), jnp.float32))
    assert re.search(r"if \(e == 0\) js_comb\d+\(", code) and "_later(" in code


def test_argmax_primitive_folds_later_elements_without_the_tie_break(tmp_path, monkeypatch):
    code = _code(tmp_path, monkeypatch, lambda x: jnp.argmax(jnp.exp(x) * 2.0, axis=-1),
                 sds((4096, 64), jnp.float32))
    assert re.search(r"if \(e == 0\) js_arg_combine<true>\([^;]*\); else js_arg_combine<true, true>\(", code)


def test_values_that_are_not_the_column_keep_the_combiner(tmp_path, monkeypatch):
    """An index iota of another stride (here: every column's index halved) is not ascending."""
    def halved(x):
        i = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) // 2
        return jax.lax.reduce((x, i), (-jnp.inf, 0), top1_pair, (1,))

    code = _code(tmp_path, monkeypatch, halved, sds((4096, 64), jnp.float32))
    assert "js_comb" in code and "_later" not in code


@pytest.mark.parametrize("fun, specs, barrier", [
    (moe_router, (sds((1 << 20, 64), jnp.bfloat16),), False),  # 4 threads a row: shuffles only
    (argmax_with_value, (sds((300, 1000), jnp.bfloat16),), True),  # warps a row: js_red rounds
])
def test_row_loop_barrier_only_where_shared_memory_is_shared(tmp_path, monkeypatch, fun, specs, barrier):
    code = _code(tmp_path, monkeypatch, fun, *specs)
    kernel = code[code.index("__global__"):]
    loop = kernel[kernel.index("for (long long base"):]
    assert "js_stage_wait<1>();" in loop  # two stages
    top = loop[:loop.index("js_buf ^= 1;")]
    assert ("__syncthreads();" in top) == barrier


def test_one_hot_is_not_split_where_warps_hold_whole_rows(tmp_path, monkeypatch):
    """Every warp holds its rows' hits: a copy for vectors that miss would run beside the general
    one in every warp (codegen._split_one_hot). Rows walked in chunks keep the split."""
    assert "js_hit" not in _code(tmp_path / "a", monkeypatch, moe_router, sds((1 << 20, 64), jnp.bfloat16))
    xent = WORKLOADS["xent_fwdbwd"]
    specs = [sds(a.shape, a.dtype) for a in xent.make_inputs(jax.random.key(0), jnp.dtype("float32"), True)]
    assert "if (!js_hit" in _code(tmp_path / "b", monkeypatch, xent.fn, *specs)
