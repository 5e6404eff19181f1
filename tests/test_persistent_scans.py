"""Persistent scans on the CPU (plan/scan.py): which scans become one kernel and why others stay XLA
loops, the kinds planning finds (batch rows, whole values, sums over rows), that every kernel NVRTC
compiles, and that the CPU fallback gives jax.jit's results. The GPU runs are in
test_gpu_persistent_scans.py."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxstitch
from jaxstitch import partition, trace as trace_mod
from jaxstitch.kernels import nvrtc
from jaxstitch.lowering import codegen
from jaxstitch.plan import scan as S
from jaxstitch.targets import TARGETS
from recurrent import CASES, gru_grad, gru_inputs
from strategies import assert_same_as_jax_jit


def scan_plans(fn, args):
    """(ScanPlan, estimate) or the Unplannable message, for each scan of fn's program."""
    traced = trace_mod.trace(fn, args, trace_mod.positional_tree(args))
    out = []
    for op, eqn in zip(traced.graph.ops, traced.eqns):
        if op.prim != "scan":
            continue
        region = partition.Region(0, (op,), tuple(dict.fromkeys(a for a in op.inputs if hasattr(a, "id"))),
                                  op.outputs)
        try:
            out.append(S.plan_scan(region, trace_mod.scan_body(eqn), TARGETS["h100"]))
        except S.Unplannable as e:
            out.append(str(e))
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_explain_says_which_scans_are_one_kernel(name):
    fn, make, planned = CASES[name]
    scans = [r for r in jaxstitch.explain(fn, *make(), target="h100").regions if r.ops == ("scan",)]
    assert scans
    for r in scans:
        assert r.stitched == planned, r.reason
        if planned:
            assert r.scheme == "scan" and r.mapping.startswith("persistent scan") and r.est_us < r.xla_est_us
        else:
            assert r.reason.startswith("one kernel cannot hold it")


def test_gru_gradient_sums_the_weight_gradient_over_rows():
    """The backward scan's weight-gradient carry is a sum over rows: each block keeps its rows'
    share and the shares meet once, after the last step (one grid barrier)."""
    forward, backward = scan_plans(gru_grad, gru_inputs(256))
    assert forward[0].mapping.batch == 256 and not forward[0].mapping.cooperative
    plan = backward[0]
    kinds = [plan.kind(v).kind for v, _ in plan.carries]
    assert sorted(kinds) == [S.BATCHED, S.PARTIAL]
    assert plan.mapping.cooperative and plan.workspace_bytes == plan.mapping.grid * 36 * 108 * 4
    assert (plan.mapping.grid, plan.mapping.rows) == (128, 2)


def test_batch_axis_is_the_one_that_keeps_blocks_small():
    """Both 256 (the batch) and 36 (the features) appear in every per-step input; only the batch
    leaves each block a few rows of each value."""
    plan = scan_plans(gru_grad, gru_inputs(256))[1][0]
    assert plan.mapping.batch == 256 and plan.mapping.smem_bytes < 100_000


def test_scans_off_leaves_xla_loops(monkeypatch):
    monkeypatch.setenv("JAXSTITCH_TUNE", "scans=0")
    fn, make, _ = CASES["gru_fwd"]
    assert not [r for r in jaxstitch.explain(fn, *make(), target="h100").regions if r.ops == ("scan",)]


@pytest.mark.skipif(not nvrtc.available(), reason="NVRTC not installed")
@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c[2]))
def test_every_scan_kernel_compiles(name):
    fn, make, _ = CASES[name]
    for plan, _ in scan_plans(fn, make()):
        _, res = nvrtc.compile_cubin(codegen.render(plan).code, "sm_90")
        assert res.spill_bytes == 0


@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_fallback_is_jax_jit(name):
    fn, make, _ = CASES[name]
    assert_same_as_jax_jit(fn, make())


def test_grad_of_a_stitched_scan_stitches_both_loops():
    """jax.grad(jaxstitch.jit(gru)): the JVP rule linearizes the region holding the scan, so the
    primal scan (saving residuals) and the transposed tangent scan are each planned again as one
    kernel, and the fallback gives jax.jit's gradient."""
    from test_transforms import stitched_kernels
    from recurrent import gru
    kernel, h0, gx, mask = gru_inputs(64, steps=12, seed=3)

    def loss(f):
        return lambda k, g: (f(k, h0, g, mask) ** 2).sum()
    grad = jax.grad(loss(jaxstitch.jit(gru, target="h100")), argnums=(0, 1))
    closed = jax.make_jaxpr(grad)(kernel, gx)
    scans = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    assert stitched_kernels(closed) >= 2 and not scans
    want = jax.grad(loss(gru), argnums=(0, 1))(kernel, gx)
    for g, w in zip(jax.jit(grad)(kernel, gx), want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
