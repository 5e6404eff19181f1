"""Compile latency on the CPU: a build's seconds by stage (trace, partition, plan, NVRTC waited on,
bodies) add up to no more than the build, explain's head and the INFO summary line show them, and
jaxstitch.jit logs XLA's compile of the program it rebuilt (jax.monitoring's backend-compile event
fires on a CPU too); a shape family's per-shape compiles are counted by xla_compiling."""
from __future__ import annotations

import logging
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstitch
from jaxstitch.driver import build_times
from jaxstitch.integration import xla_compiles
from jaxstitch.driver.build_times import STAGES, BuildTimes
from jaxstitch.kernels import nvrtc
from jaxstitch.driver.report import WIDTH, Report
from jaxstitch.bench.workloads import layernorm_fwdbwd

needs_nvrtc = pytest.mark.skipif(not nvrtc.available(), reason="NVRTC is not installed")
S = jax.ShapeDtypeStruct
X, G = S((256, 1024), jnp.float32), S((1024,), jnp.float32)


def _adds_up(t: BuildTimes):
    """Every stage non-negative, and together within the build (NVRTC's wait is within it; its CPU
    time, summed over compiles side by side, may exceed it)."""
    stages = [getattr(t, s) for s in STAGES]
    assert all(v >= 0 for v in stages), t
    assert sum(stages) <= t.total + 1e-6, t
    assert t.nvrtc_busy <= t.total + 0.05, t
    assert t.total > 0 and t.trace > 0 and t.partition > 0 and t.plan > 0, t


def test_nested_stages_count_each_second_once():
    """The innermost stage takes the time; a block `apart` (a body's build) counts whole to its
    stage, its own stages staying out."""
    with build_times.measuring() as m:
        with build_times.stage("plan"):
            time.sleep(0.02)
            with build_times.stage("nvrtc"):
                time.sleep(0.02)
            with build_times.apart("bodies"):
                with build_times.stage("trace"):
                    time.sleep(0.02)
    t = m.times()
    assert t.trace == 0.0 and t.partition == 0.0
    assert t.plan == pytest.approx(0.02, abs=0.015) and t.nvrtc == pytest.approx(0.02, abs=0.015)
    assert t.bodies == pytest.approx(0.02, abs=0.015)
    assert sum(getattr(t, s) for s in STAGES) <= t.total
    with build_times.stage("plan"):  # (outside a build: nothing to count into)
        pass


@needs_nvrtc
def test_explain_head_shows_the_stages_and_they_add_up():
    report = jaxstitch.explain(layernorm_fwdbwd, X, G, G, X, target="h100")
    _adds_up(report.times)
    text = str(report)
    line = next(ln for ln in text.splitlines() if ln.startswith("built in stages: "))
    for stage in ("trace", "partition", "plan", "NVRTC wait"):
        assert re.search(rf"\b{stage} [\d.]+ s\b", line), line
    assert text.index("\nbuilt in stages:") > text.index("\nbuilt in ")  # (under the total)
    assert all(len(ln) <= WIDTH for ln in text.splitlines()[:4]), text


def test_head_line_wraps_long_times_within_the_width():
    t = BuildTimes(total=999.99, trace=123.45, partition=123.45, plan=123.45, nvrtc=123.45, bodies=123.45)
    lines = str(Report("h100", (), (), times=t)).splitlines()
    assert lines[1].startswith("built in stages: trace 123.45 s, partition 123.45 s")
    assert all(len(ln) <= WIDTH for ln in lines), lines
    assert "other 382.74 s" in " ".join(lines)


@needs_nvrtc
def test_info_summary_line_has_the_stages(caplog):
    with caplog.at_level(logging.INFO, logger="jaxstitch"):
        jaxstitch.explain(layernorm_fwdbwd, X, G, G, X, target="h100")
    (summary,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("built layernorm_fwdbwd")]
    assert re.search(r"; trace [\d.]+ s, partition [\d.]+ s, plan [\d.]+ s, NVRTC wait [\d.]+ s", summary), summary


def scaled_softmax(x, w):
    return jax.nn.softmax(x * w, axis=-1) * 2.0


def test_jit_logs_xla_compile_of_the_rebuilt_program(caplog):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 512)), jnp.float32)
    w = jnp.ones((512,), jnp.float32)
    f = jaxstitch.jit(scaled_softmax, target="h100")
    with caplog.at_level(logging.INFO, logger="jaxstitch"):
        np.testing.assert_allclose(f(x, w), jax.jit(scaled_softmax)(x, w), rtol=1e-5, atol=1e-6)
        f(x, w)  # (compiled already: nothing more to log)
    lines = [r.getMessage() for r in caplog.records if "compiled by XLA" in r.getMessage()]
    assert len(lines) == 1, lines
    assert re.fullmatch(r"jaxstitch: scaled_softmax compiled by XLA in [\d.]+ s \(our build [\d.]+ s: "
                        r"trace [\d.]+ s, partition [\d.]+ s, plan [\d.]+ s, NVRTC wait [\d.]+ s.*\)", lines[0]), lines
    record = jaxstitch.xla_compiles()[-1]  # (the public name of xla_compiles.compiles)
    assert record.name == "scaled_softmax" and record.module == "jit(scaled_softmax)", record
    assert record.seconds > 0 and isinstance(record.build, BuildTimes)
    _adds_up(record.build)


def test_an_enclosing_jit_takes_no_record():
    """Stitched inside another jax.jit, the compile that follows is the enclosing program's: not
    recorded as ours (nor left waiting for a later compile)."""
    inner = jaxstitch.jit(scaled_softmax, target="h100")
    before = len(xla_compiles.compiles())
    jax.jit(lambda x, w: inner(x, w) + 1.0)(jnp.ones((8, 128)), jnp.ones((128,)))
    jax.jit(lambda x: x * 3.0)(jnp.ones((8, 128)))  # (a later, unrelated compile)
    assert len(xla_compiles.compiles()) == before


def test_family_compiles_per_shape_are_counted():
    """A shape family (jax.export with a symbolic batch) lowers without compiling; each new shape
    the exported program is called at is one XLA compile, counted by xla_compiling."""
    b, = jax.export.symbolic_shape("b")
    exported = jax.export.export(jaxstitch.jit(scaled_softmax, target="h100"), platforms=["cpu", "cuda"],
                                 disabled_checks=jaxstitch.disabled_checks())(
        S((b, 512), jnp.float32), S((512,), jnp.float32))
    call = jax.jit(exported.call)
    w = jnp.ones((512,), jnp.float32)
    with xla_compiles.xla_compiling() as seen:
        for rows in (3, 5, 5):
            call(jnp.ones((rows, 512), jnp.float32), w)
    ours = [(m, s) for m, s in seen if m == "jit(call)"]
    assert len(ours) == 2 and all(s > 0 for _, s in ours), seen


@needs_nvrtc
def test_a_region_is_planned_once_where_its_first_kernel_holds(monkeypatch):
    """prefetch's plan and source are compile_region's first try: a region whose first kernel
    compiles without spilling is planned and rendered once (partition's checks aside)."""
    from jaxstitch.core import config
    from jaxstitch.integration import families
    from jaxstitch.driver import pipeline
    from jaxstitch.frontend import trace as trace_mod
    from jaxstitch.lowering import codegen
    from jaxstitch.plan import candidates

    planned, rendered = [], []
    plan_region, render = pipeline.plan_region, codegen.render
    counted = lambda r, *a, **k: planned.append(id(r)) or plan_region(r, *a, **k)  # noqa: E731
    monkeypatch.setattr(pipeline, "plan_region", counted)
    monkeypatch.setattr(candidates, "plan_region", counted)
    monkeypatch.setattr(codegen, "render", lambda k: rendered.append(id(k)) or render(k))
    x, g = S((2048, 1024), jnp.bfloat16), S((1024,), jnp.bfloat16)  # (one region, stitched)
    specs = [x, g, g, x]
    program = families.build_any(layernorm_fwdbwd, specs, trace_mod.positional_tree(specs),
                                 jaxstitch.get_target("h100"), config.load())
    assert any(c.stitched for c in program.regions) and not any(c.tried for c in program.regions)
    for c in program.regions:
        assert planned.count(id(c.plan.region)) == 1, c.plan.region
    assert len(rendered) == sum(c.source is not None for c in program.regions)
