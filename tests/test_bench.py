"""CPU tests of the benchmark workloads and of jaxstitch.bench (kernel counting, tables, the CLI)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstitch.bench import runner as bench
from jaxstitch.bench.workloads import WORKLOADS, workload_names

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------
# Workloads
# ----------------------------------------------------------------------------------------------------

def test_suite_names():
    assert workload_names() == list(WORKLOADS)
    assert {"layernorm_fwd", "layernorm_fwdbwd", "rmsnorm_residual_fwdbwd", "softmax_fwd",
            "softmax_fwdbwd", "xent_fwdbwd", "bias_gelu_dropout", "fig7_chain"} <= set(WORKLOADS)
    for name, w in WORKLOADS.items():
        assert w.name == name


FLOAT32_INPUTS = ("adamw_bert", "rmsnorm_rope_fwd", "rmsnorm_rope_fwdbwd")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", workload_names())
def test_workload_inputs_and_run(name, dtype):
    w = WORKLOADS[name]
    args = w.make_inputs(jax.random.key(0), dtype, True)
    assert isinstance(args, tuple) and args
    # (the optimizer's shape is the model's: layers, hidden, vocab; the GRU's is batch, steps, hidden)
    if name not in ("adamw_bert", "dien_gru_fwdbwd"):
        assert args[0].shape == tuple(w.quick_shape) and args[0].dtype == dtype
    for a in jax.tree.leaves(args):
        a = np.asarray(a)
        if jnp.issubdtype(a.dtype, jnp.floating):  # (float32: AdamW's moments, rotary angles)
            assert a.dtype == dtype or (name in FLOAT32_INPUTS and a.dtype == np.float32)
            assert np.mean(a == 0) < 0.01, "float inputs must be random, not zeros"
            assert a.size == 1 or np.std(a.astype(np.float32)) > 0  # (a scalar: the step count)
        else:
            assert a.dtype in (np.int32, np.uint32, np.bool_), a.dtype
            assert np.any(a != 0)
    out = jax.block_until_ready(jax.jit(w.fn)(*args))
    for leaf in jax.tree.leaves(out):
        assert np.all(np.isfinite(np.asarray(leaf, np.float32))), name


def test_workload_inputs_differ_by_key():
    w = WORKLOADS["softmax_fwd"]
    (a,) = w.make_inputs(jax.random.key(0), jnp.float32, True)
    (b,) = w.make_inputs(jax.random.key(1), jnp.float32, True)
    assert not np.array_equal(a, b)


def test_xent_labels_in_vocab():
    logits, labels = WORKLOADS["xent_fwdbwd"].make_inputs(jax.random.key(0), jnp.float32, True)
    assert labels.dtype == jnp.int32 and labels.shape == logits.shape[:1]
    assert 0 <= int(labels.min()) and int(labels.max()) < logits.shape[1] == 32000


# ----------------------------------------------------------------------------------------------------
# count_kernels
# ----------------------------------------------------------------------------------------------------

TWO_FUSIONS_AND_A_CUSTOM_CALL = """\
HloModule jit_f, is_scheduled=true, entry_computation_layout={(f32[64,128]{1,0})->f32[64,128]{1,0}}

%region_0.1 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

%fused_computation (param_0: f32[64,128]) -> f32[64] {
  %param_0 = f32[64,128]{1,0} parameter(0)
  %constant.1 = f32[] constant(0)
  %exp = f32[64,128]{1,0} exponential(%param_0)
  ROOT %reduce = f32[64]{0} reduce(%exp, %constant.1), dimensions={1}, to_apply=%region_0.1
}

%fused_computation.1 (param_0.1: f32[64,128], param_1.1: f32[64]) -> (f32[64,128], f32[64,128]) {
  %param_0.1 = f32[64,128]{1,0} parameter(0)
  %param_1.1 = f32[64]{0} parameter(1)
  %broadcast = f32[64,128]{1,0} broadcast(%param_1.1), dimensions={0}
  %divide = f32[64,128]{1,0} divide(%param_0.1, %broadcast)
  %copy.9 = f32[64,128]{1,0} copy(%divide)
  ROOT %tuple.9 = (f32[64,128]{1,0}, f32[64,128]{1,0}) tuple(%divide, %copy.9)
}

ENTRY %main.4 (x.1: f32[64,128]) -> f32[64,128] {
  %x.1 = f32[64,128]{1,0} parameter(0), metadata={op_name="x"}
  %constant.6 = f32[] constant(0)
  %input_reduce_fusion = f32[64]{0} fusion(%x.1), kind=kInput, calls=%fused_computation
  %loop_fusion = (f32[64,128]{1,0}, f32[64,128]{1,0}) fusion(%x.1, %input_reduce_fusion), kind=kLoop, calls=%fused_computation.1
  %get-tuple-element = f32[64,128]{1,0} get-tuple-element(%loop_fusion), index=0
  %bitcast.1 = f32[8192]{0} bitcast(%get-tuple-element)
  ROOT %custom-call.1 = f32[64,128]{1,0} custom-call(%get-tuple-element), custom_call_target="jaxstitch_launch", api_version=API_VERSION_TYPED_FFI
}
"""

COMMAND_BUFFER = """\
HloModule jit_g, is_scheduled=true

%fused_a (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %neg = f32[8]{0} negate(%p0)
}

%fused_b (p1: f32[8]) -> f32[8] {
  %p1 = f32[8]{0} parameter(0)
  ROOT %exp = f32[8]{0} exponential(%p1)
}

%command_buffer (p: f32[8]) -> (f32[8], f32[8]) {
  %p = f32[8]{0} parameter(0)
  %fusion.1 = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused_a
  %fusion.2 = f32[8]{0} fusion(%fusion.1), kind=kLoop, calls=%fused_b
  %custom-call.3 = f32[8]{0} custom-call(%fusion.2), custom_call_target="jaxstitch_launch"
  ROOT %t = (f32[8]{0}, f32[8]{0}) tuple(%fusion.2, %custom-call.3)
}

ENTRY %main (x: f32[8]) -> (f32[8], f32[8]) {
  %x = f32[8]{0} parameter(0)
  %call = (f32[8]{0}, f32[8]{0}) call(%x), to_apply=%command_buffer
  %gte.0 = f32[8]{0} get-tuple-element(%call), index=0
  %gte.1 = f32[8]{0} get-tuple-element(%call), index=1
  %fusion.4 = f32[8]{0} fusion(%gte.0), kind=kLoop, calls=%fused_a
  ROOT %out = (f32[8]{0}, f32[8]{0}) tuple(%fusion.4, %gte.1)
}
"""

# No `%` sigils and a `while`: its condition and body each hold one fusion; the loop itself is no kernel.
WHILE_NO_SIGILS = """\
HloModule jit_h

fused_cond (p: s32[]) -> pred[] {
  p = s32[] parameter(0)
  c = s32[] constant(10)
  ROOT lt = pred[] compare(p, c), direction=LT
}

cond (s: (s32[], f32[8])) -> pred[] {
  s = (s32[], f32[8]{0}) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  ROOT f = pred[] fusion(i), kind=kLoop, calls=fused_cond
}

body (s.1: (s32[], f32[8])) -> (s32[], f32[8]) {
  s.1 = (s32[], f32[8]{0}) parameter(0)
  ROOT f.1 = (s32[], f32[8]{0}) fusion(s.1), kind=kLoop, calls=fused_cond
}

ENTRY main (x: f32[8]) -> f32[8] {
  x = f32[8]{0} parameter(0)
  zero = s32[] constant(0)
  init = (s32[], f32[8]{0}) tuple(zero, x)
  loop = (s32[], f32[8]{0}) while(init), condition=cond, body=body
  ROOT r = f32[8]{0} get-tuple-element(loop), index=1
}
"""


def test_count_kernels_fusions_and_custom_call():
    # Two fusions + one custom-call in ENTRY; the reduce / copy inside fused bodies are not launches.
    assert bench.count_kernels(TWO_FUSIONS_AND_A_CUSTOM_CALL) == 3


def test_count_kernels_unfused_ops_count():
    hlo = TWO_FUSIONS_AND_A_CUSTOM_CALL.replace(
        "  ROOT %custom-call.1",
        "  %copy.2 = f32[64,128]{1,0} copy(%get-tuple-element)\n  ROOT %custom-call.1")
    assert bench.count_kernels(hlo) == 4


def test_count_kernels_command_buffer_counted_by_contents():
    # 3 launches inside the command buffer + 1 fusion in ENTRY; the `call` wrapper is not a launch.
    assert bench.count_kernels(COMMAND_BUFFER) == 4


def test_count_kernels_while_without_sigils():
    assert bench.count_kernels(WHILE_NO_SIGILS) == 2


def test_count_kernels_needs_entry():
    with pytest.raises(ValueError):
        bench.count_kernels("HloModule empty\n")


def test_count_kernels_on_compiled_hlo():
    x = jnp.ones((64, 128))
    n = bench.compiled_kernels(jax.jit(lambda v: jax.nn.softmax(v) * 2.0), (x,))
    assert n is not None and n >= 1


# ----------------------------------------------------------------------------------------------------
# Timing, errors, tables
# ----------------------------------------------------------------------------------------------------

def test_time_fn_and_pick_inner():
    f = jax.jit(lambda v: v + 1)
    x = jnp.ones((16,))
    assert bench.time_fn(f, (x,), reps=3, inner=2) > 0
    assert 1 <= bench.pick_inner(f, (x,)) <= bench.MAX_INNER


def test_spread_is_the_interquartile_range_over_the_median():
    assert bench.spread_pct([10.0, 10.0, 10.0, 10.0]) == 0.0
    assert bench.spread_pct([9.0, 10.0, 11.0, 12.0, 100.0]) == pytest.approx(200 / 11)  # (one slow repeat barely moves it)
    assert bench.spread_pct([5.0]) == 0.0
    (median, spread), = bench.timed_spread([jax.jit(lambda v: v * 2)], (jnp.ones((8,)),), reps=4, inners=[2])
    assert median > 0 and spread >= 0


def test_max_rel_err_worst_leaf():
    want = (jnp.array([1.0, -4.0]), jnp.array([2.0, 2.0], jnp.bfloat16))
    got = (jnp.array([1.0, -4.0]), jnp.array([2.0, 2.5], jnp.bfloat16))
    assert bench.max_rel_err(got, want) == pytest.approx(0.25)
    assert bench.max_rel_err(want, want) == 0.0


def _row(name="softmax_fwd", **kw):
    row = {"workload": name, "dtype": "float32", "jit_us": 120.0, "stitch_us": 60.0, "speedup": 2.0,
           "roofline_stitch": 0.8, "roofline_jit": 0.4, "kernels_jit": 3, "kernels_stitch": 1,
           "max_rel_err": 1e-6, "jit_spread_pct": 1.5, "stitch_spread_pct": 3.0}
    row.update(kw)
    return row


def test_tables():
    meta = {"device": "NVIDIA H200", "date": "2026-01-01T00:00:00", "bandwidth_gbs": 4000.0,
            "jax_version": "0.11.2", "quick": False}
    rows = [_row(jit_triton_us=118.0), _row("xent_fwdbwd", kernels_stitch=None),
            {"workload": "fig7_chain", "dtype": "bfloat16", "error": "RuntimeError: boom"}]
    text = bench.format_table(rows, meta)
    assert "NVIDIA H200" in text and "4000 GB/s" in text and "0.11.2" in text
    assert "2.00x" in text and "80%" in text and "40%" in text and "3→1" in text and "3→?" in text
    assert "fig7_chain  bfloat16  ERROR: RuntimeError: boom" in text
    cells = [line.split() for line in text.splitlines() if line.startswith(("softmax_fwd", "xent_fwdbwd"))]
    assert [c[6] for c in cells] == ["118.0", "-"]  # (jax.jit with XLA's Triton flags; not run: "-")
    assert [c[5] for c in cells] == ["1.5/3.0", "1.5/3.0"]  # (the repeats' spread, jit/stitch)
    md = bench.format_markdown(rows, meta).splitlines()
    assert md[2].startswith("| workload | dtype | jax.jit µs | jaxstitch µs | speedup |")
    assert all(line.count("|") == len(bench.COLUMNS) + 1 for line in md[2:-2])


def test_summary_is_the_geomean_and_the_slowest_case():
    rows = [_row(speedup=4.0), _row("xent_fwdbwd", speedup=1.0), _row("fig7_chain", speedup=0.5),
            {"workload": "adamw_bert", "dtype": "float32", "error": "RuntimeError: boom"}]
    assert bench.summary_line(rows) == ("geomean speedup over 3 cases: 1.26x; slowest: fig7_chain "
                                        "float32 0.50x")
    assert bench.format_table(rows[:1], {"device": "d", "date": "t", "bandwidth_gbs": 1.0,
                                         "jax_version": "v", "quick": True}).endswith("slowest: softmax_fwd float32 4.00x")


def test_bench_without_stitch_jit_exits_with_error(monkeypatch, capsys):
    monkeypatch.setattr(bench, "stitch_jit", lambda: None)
    assert bench.main(["--quick"]) == 2
    assert "jaxstitch.jit is not available" in capsys.readouterr().err


def test_bench_cli_end_to_end(tmp_path):
    import jaxstitch
    if not hasattr(jaxstitch, "jit"):
        pytest.skip("jaxstitch.jit is not there yet (the public API has not landed)")
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-m", "jaxstitch.bench", "--quick", "--only", "softmax_fwd", "--dtype", "float32",
         "--json", str(out), "--markdown"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "softmax_fwd" in proc.stdout and "| workload |" in proc.stdout
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert row["workload"] == "softmax_fwd" and row["jit_us"] > 0 and row["stitch_us"] > 0
    assert row["jit_spread_pct"] >= 0 and row["stitch_spread_pct"] >= 0
    assert row["max_rel_err"] < 1e-4
    assert data["meta"]["bandwidth_gbs"] > 0
