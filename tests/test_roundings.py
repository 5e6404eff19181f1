"""Where our kernels round half-precision values (wide_converts.py, cuda_ops.written_half,
recompute._unrounds): on the CPU, from the graph, the plans and the generated source. The GPU
comparison is test_gpu_correctness.py's test_attention_gradients_keep_their_identities."""
from __future__ import annotations

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

import jaxstitch
from strategies import force_stitching
from jaxstitch.core import config, ir
from jaxstitch.driver import pipeline
from jaxstitch.frontend import trace as trace_mod
from jaxstitch.graph import wide_converts
from jaxstitch.lowering import codegen
from jaxstitch.plan import mapping

from test_batched_products import bias_attention_grads, bias_specs

S = jax.ShapeDtypeStruct


def _graph(fn, *specs) -> ir.Graph:
    return trace_mod.trace(fn, list(specs), trace_mod.positional_tree(specs)).graph


def _marked(fn, *specs) -> list[ir.Op]:
    return [op for op in wide_converts.widen(_graph(fn, *specs)).ops if op.param(wide_converts.KEEP_FLOAT)]


def _softmax(x):
    return jax.nn.softmax(x, axis=-1)


def test_a_softmax_divides_by_its_unrounded_sum():
    """jax.nn.softmax in bfloat16 sums in float32 and converts the sum to bfloat16 before dividing:
    only a divide reads it, so the conversion keeps the float (XLA's SimplifyFPConversions)."""
    (op,) = _marked(_softmax, S((64, 128), jnp.bfloat16))
    assert op.inputs[0].dtype == "float32" and op.outputs[0].dtype == "bfloat16"
    assert not _marked(_softmax, S((64, 128), jnp.float32))
    assert not _marked(_softmax, S((64, 128), jnp.float16))  # (float16's rounding may overflow)


def _compared(x):
    y = x.astype(jnp.bfloat16)
    return y * 2, y == jnp.bfloat16(1)


def _compared_through_a_reshape(x):
    y = x.astype(jnp.bfloat16)
    return y * 2, jnp.max(y.reshape(8, 16), axis=-1) > 0


def _to_int(x):
    y = x.astype(jnp.bfloat16)
    return y * 2, y.astype(jnp.int32)


def _selected(x, p):
    y = x.astype(jnp.bfloat16)
    return jnp.where(p, y, jnp.bfloat16(0)) / 3


@pytest.mark.parametrize("fn,marked", [(_compared, 0), (_compared_through_a_reshape, 0), (_to_int, 0), (_selected, 1)],
                         ids=["compare", "compare_after_reshape_and_max", "to_int", "select_then_divide"])
def test_discrete_readers_keep_the_rounding(fn, marked):
    """A compare or a conversion to an integer reads the rounded value (directly, or through ops
    passing values along): the conversion keeps its rounding. A select passes it to a divide."""
    specs = [S((128,), jnp.float32)] + ([S((128,), jnp.bool_)] if fn is _selected else [])
    assert len(_marked(fn, *specs)) == marked


def _kernel_sources(fn, specs, tune: str = "", forced: bool = False):
    """The program's stitched kernels' sources; `forced`: with the cost model's veto lifted (the
    attention's regions at these small shapes are launch-bound, left to XLA by default)."""
    cfg = config.load()
    if tune:
        cfg = dataclasses.replace(cfg, tuning=config.Tuning.parse(tune))
    tree = jax.tree_util.tree_structure((tuple(specs), {}))
    with force_stitching() if forced else contextlib.nullcontext():
        program = pipeline.build(fn, list(specs), tree, jaxstitch.get_target("h100"), cfg)
    return {r.plan.region.id: codegen.render(r.plan.kernel).code for r in program.regions if r.stitched}, program


ATTENTION = bias_specs(jnp.bfloat16, 3, 72, 3 * 40)


def _softmax_regions(program):
    return [r for r in program.regions if r.stitched and any(op.prim == "exp" for op in r.plan.region.ops)]


def test_a_written_value_is_read_rounded_in_its_own_kernel():
    """The attention forward writes its row max in bfloat16 (its backward recomputes the
    exponentials from it): the forward subtracts the rounded max too, and stores it once rounded."""
    sources, program = _kernel_sources(bias_attention_grads, ATTENTION, forced=True)
    forward = min(_softmax_regions(program), key=lambda r: r.plan.region.id)
    code = sources[forward.plan.region.id]
    written = {o.id for o in forward.plan.region.outputs if o.dtype == "bfloat16"}
    subtracted = re.findall(r"- js_round_bf16\(v(\d+)\)\)", code)
    assert subtracted and {int(v) for v in subtracted} <= written, code
    assert not re.search(r"::put\(js_round_bf16", code)  # (the store rounds once)


def test_the_backward_reads_the_forward_sum_in_float32():
    """With wide_converts=1, the softmax backward takes in the conversion of the forward's float32
    sum (recompute._unrounds), so it divides by what the forward divided by, and keeps the fast
    exp; without it, it reads the bfloat16 sum the forward writes and reads itself."""
    _, program = _kernel_sources(bias_attention_grads, ATTENTION, "wide_converts=1", forced=True)
    forward, backward = sorted(_softmax_regions(program), key=lambda r: r.plan.region.id)
    sums = [v for v in backward.plan.region.inputs if v.dtype == "float32"]
    assert sums and all(v in forward.plan.region.outputs for v in sums)
    assert backward.plan.kernel.fast_exp
    _, rounded = _kernel_sources(bias_attention_grads, ATTENTION, forced=True)  # (wide_converts=0, the default)
    _, backward0 = sorted(_softmax_regions(rounded), key=lambda r: r.plan.region.id)
    assert not [v for v in backward0.plan.region.inputs if v.dtype == "float32"]


def test_the_report_counts_the_conversions(monkeypatch):
    assert "unrounded" not in str(jaxstitch.explain(bias_attention_grads, *ATTENTION, target="h100"))
    monkeypatch.setenv("JAXSTITCH_TUNE", "wide_converts=1")
    rep = str(jaxstitch.explain(bias_attention_grads, *ATTENTION, target="h100"))
    assert re.search(r"\d+ conversions to bfloat16 unrounded", rep), rep


def test_wide_converts_takes_0_or_1():
    assert config.Tuning.parse("wide_converts=0").wide_converts == 0
    with pytest.raises(ValueError, match="wide_converts=2"):
        config.Tuning.parse("wide_converts=2")


def momentum_steps(*leaves):
    """SGD with momentum over (m, g, p) triples: the new momentum, written, is read by the update."""
    out = []
    for m, g, p in zip(leaves[0::3], leaves[1::3], leaves[2::3]):
        m = 0.9 * m + g
        out += [m, p - 1e-2 * m]
    return out


def momentum_specs(dtype):
    return [S(shape, dtype) for shape in [(768,), (3072,), (768, 64), (1000,)] for _ in range(3)]


@pytest.mark.parametrize("dtype,rounding", [(jnp.bfloat16, "js_round_bf16"), (jnp.float16, "js_round_f16")])
def test_a_remote_update_reads_the_momentum_it_writes_rounded(dtype, rounding):
    """Momentum updates of several small leaves are one remote kernel; each writes its new
    momentum in the half type and the parameter's update reads it rounded, as written (the store
    rounds the float once). In float32 nothing is rounded."""
    sources, program = _kernel_sources(momentum_steps, momentum_specs(dtype))
    (kernel,) = [r for r in program.regions if r.stitched]
    assert kernel.plan.kernel.scheme == "remote"
    code = sources[kernel.plan.region.id]
    read = re.findall(rf"\* {rounding}\(v(\d+)\[e\]\)\)", code)
    written = {o.id for o in kernel.plan.region.outputs}
    assert read and {int(v) for v in read} <= written, code
    assert not re.search(rf"t\d+\[e\] = {rounding}", code)  # (stored from the float)
    f32, _ = _kernel_sources(momentum_steps, momentum_specs(jnp.float32))
    assert "js_round" not in "".join(f32.values()).split("__global__", 1)[1]


def test_a_scan_keeps_its_half_carry_in_float():
    """A GRU over a sequence (lax.scan) in bfloat16: the persistent scan keeps the hidden state a
    float from step to step, where XLA rounds it to bfloat16 every step. Rounding it (and the
    per-step results the backward reads) where the step makes them was tried: over
    50 steps its forward and backward results went from 3-4x nearer float32 than jax.jit's to about
    as far, and no nearer jax.jit's own (H100, scripts/rounding_probe.py --case gru). So the carry's
    new value is copied unrounded into the next step."""
    from jaxstitch.bench.workloads import WORKLOADS

    specs = jax.eval_shape(lambda k: WORKLOADS["dien_gru_fwdbwd"].make_inputs(k, jnp.bfloat16, True),
                           jax.random.key(0))
    sources, program = _kernel_sources(WORKLOADS["dien_gru_fwdbwd"].fn, specs)
    scans = [r for r in program.regions if r.stitched and r.plan.kernel.scheme == "scan"]
    assert len(scans) == 2
    for r in scans:
        kernel = sources[r.plan.region.id].split("__global__", 1)[1]
        advance = kernel.split("every read of this step's carries and inputs is done", 1)[1]
        carried = re.findall(r"  s\d+\[e\] = s(\d+)\[e\];", advance)
        assert carried, kernel
        assert "js_round" not in kernel, kernel
