"""The model zoo (examples/zoo) on a CPU, at the QUICK configs, one dtype a model (alternating down
the registry):

* the entries in RUN (with JAXSTITCH_ZOO_ALL=1, every entry) run two steps under
  jaxstitch.jit planned for an H100 (the stitched regions run through XLA here) from the same init
  and batches as jax.jit, to the same losses, and the step at the state reached, planned for an
  H200, stitches at least one region (tracing, partition, planning and NVRTC all pass under
  JAXSTITCH_STRICT). The other entries' XLA compiles on a CPU (convolution and normalisation
  backward passes) would take the file past a minute: by default their steps are planned for an
  H200 from their shapes alone (no arrays drawn, nothing compiled by XLA) and must stitch a region;
* scripts/zoo.py's dry run (--target) measures a tiny model end to end;
* the registry has the families the zoo promises.

XLA's CPU backend optimisations and fusion emitters are off for both compilers alike (a U-Net's
compile drops from ~7 s to under 2 s); the comparison is of the programs, not of LLVM's code.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys

import jax
import numpy as np
import pytest

import jaxstitch

pytest.importorskip("optax")
pytest.importorskip("flax")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))
import zoo  # noqa: E402
from zoo import common  # noqa: E402

FAST = common.CPU_QUICK_COMPILE
DTYPE = {name: ("float32", "bfloat16")[i % 2] for i, name in enumerate(zoo.MODELS)}
# Run by default: BatchNorm convolutions, grouped-query attention with RoPE, relative position
# biases with Adafactor, a selective scan, embedding bags, and two inference steps (BatchNorm's
# running statistics, a decoder's prefill).
RUN = ("resnet", "llama", "t5", "mamba", "dlrm", "resnet_infer", "llama_infer")
ALL = os.environ.get("JAXSTITCH_ZOO_ALL", "") not in ("", "0")
# bfloat16: our kernels (and their CPU stand-ins) compute in float32 and round a region's outputs
# where XLA rounds after each bfloat16 op; the examples' harness allows 2e-2 there too.
RTOL = {"float32": 1e-5, "bfloat16": 2e-2}


@pytest.fixture(autouse=True)
def stitch_what_is_estimated_faster(monkeypatch):
    """At the QUICK sizes a region moves kilobytes, launch-bound on both sides, and the cost model
    rightly leaves most to XLA; JAXSTITCH_TUNE's min_gain_pct=100 keeps only its estimate's verdict
    (stitched where estimated at least as fast as XLA), so the stitched path is what runs here."""
    monkeypatch.setenv("JAXSTITCH_TUNE", "min_gain_pct=100")


def run_steps(jit, model, init, batches):
    """The losses of `model`'s step over `batches` from `init()`, compiled by `jit`, and the last
    state (a train step's donated state, as in training)."""
    graphdef, state = init()
    f = jit(functools.partial(model.step, graphdef), donate_argnums=() if model.inference else (0,),
            compiler_options=FAST)
    losses = []
    for batch in batches:
        loss, out = f(state, batch)
        state = state if model.inference else out
        losses.append(float(loss))
    return losses, graphdef, state


def assert_stitches(model, *args):
    report = jaxstitch.explain(model.step, *args, target="h200")
    assert any(r.stitched for r in report.regions), f"{model.name}: nothing stitched\n{report}"


@pytest.mark.parametrize("name", [n for n in zoo.MODELS if not (ALL or n in RUN)])
def test_zoo_step_plans_stitched_regions(name):
    """From shapes alone: no arrays drawn, no XLA compile (the steps of the models in RUN are
    planned by test_zoo_step_matches_jax_jit)."""
    model = zoo.MODELS[name]
    c = model.quick(dtype=DTYPE[name])
    graphdef, state = model.make_init(c, 0).abstract()
    assert_stitches(model, graphdef, state, jax.eval_shape(model.make_batches(c, 0), 0))


@pytest.mark.parametrize("name", [n for n in zoo.MODELS if ALL or n in RUN])
def test_zoo_step_matches_jax_jit(name):
    """Two steps from one init on the same batches: jaxstitch.jit's losses are jax.jit's, and the
    step at the state reached plans stitched regions for an H200."""
    model = zoo.MODELS[name]
    c = model.quick(dtype=DTYPE[name])
    init = model.make_init(c, 0)  # (one compiled init for both runs)
    batch = jax.jit(model.make_batches(c, 0), compiler_options=FAST)
    batches = [batch(0), batch(1)]
    want, _, _ = run_steps(jax.jit, model, init, batches)
    got, graphdef, state = run_steps(functools.partial(jaxstitch.jit, target="h100"), model, init, batches)
    assert all(np.isfinite(got)) and (model.inference or got[0] != got[1]), got
    np.testing.assert_allclose(got, want, rtol=RTOL[c.dtype])
    assert_stitches(model, graphdef, state, batches[0])


class StandInTimeline:
    """scripts/device_time.py's interface over a made-up timeline: a step of one kernel of each kind
    (our kernel 10 us, a cuBLAS gemm 20 us, an XLA fusion 5 us), so the script's GPU bookkeeping runs
    on a CPU."""

    def gpu_events(self, run):
        run()
        kernels = [("jaxstitch_kernel", 10), ("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n", 20), ("loop_add_fusion", 5)]
        return [{"cat": "kernel", "name": n, "ts": 100 * i, "dur": d} for i, (n, d) in enumerate(kernels)]

    def span_us(self, events):
        return max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)


def test_zoo_script_dry_run(tmp_path, capsys):
    """scripts/zoo.py on a CPU with --target: both compilers, the loss curves, timings, the plan, and
    (over a stand-in timeline) the GPU time's split and the roofline; then --table of the result."""
    spec = importlib.util.spec_from_file_location("zoo_script", os.path.join(ROOT, "scripts", "zoo.py"))
    script = sys.modules["zoo_script"] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up)
    spec.loader.exec_module(script)
    script.device_time = StandInTimeline()
    out = tmp_path / "zoo.json"
    records = script.main(["--target", "h100", "--quick", "--only", "dlrm", "--dtype", "float32", "--steps", "3",
                           "--rounds", "2", "--round-steps", "2", "--repeats", "2", "--keep-cache",
                           "--compiler-options", json.dumps(FAST), "--json", str(out)])
    (rec,) = json.loads(out.read_text())
    assert json.loads(json.dumps(records)) == [rec], "the records returned are those written"
    assert rec["loss_match"] and len(rec["runs"]["jaxstitch.jit"]["losses"]) == 3, rec
    assert rec["plan"]["stitched"] >= 1 and len(rec["runs"]["jax.jit"]["repeat_ms"]) == 2, rec
    assert rec["runs"]["jax.jit"]["hlo"]["xla"][0] > 0, rec
    gpu = rec["runs"]["jaxstitch.jit"]["gpu"]  # (a round of 2 steps: each kernel's time halved)
    assert (gpu["ours"], gpu["matrix"], gpu["xla"], gpu["span_ms"]) == (0.005, 0.01, 0.0025, 0.1025), gpu
    assert "| dlrm | float32 |" in capsys.readouterr().out
    assert script.main(["--table", str(out)]) == [rec]  # (the table of earlier runs)
    assert "memory-bound, GPU ms a step" in capsys.readouterr().out


def test_registry_has_the_families():
    assert len(zoo.TRAIN) >= 8 and len(zoo.INFERENCE) >= 3
    assert all(zoo.MODELS[name].inference for name in zoo.INFERENCE)
    trained = {zoo.MODELS[name].module for name in zoo.TRAIN}
    assert len(trained) == len(zoo.TRAIN), "one module a family"
    assert {zoo.MODELS[name].module for name in zoo.INFERENCE} <= trained
    for name in zoo.MODELS:
        module = zoo.MODELS[name].module
        assert module.Config().dtype == module.QUICK.dtype == "float32"
