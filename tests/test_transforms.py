"""Stitched functions under JAX's transformations and control flow (CPU, planned for an H100).

`jax.grad`, `jax.vmap`, `jax.jvp`, `jax.linearize`, `jax.checkpoint` and `jax.jit` of a
`jaxstitch.jit` function, and `jaxstitch.jit` of a `jax.grad`, must give plain JAX's results and stay
stitched: the transformed program holds `stitch` equations with kernels (transforms.py plans each
transformed region again). Regions inside `lax.scan`, `while_loop`, `fori_loop` and `cond` bodies are
planned and stitched too. Here the kernels run through their XLA fallback; the GPU test
(`test_transforms_match_xla`) runs the same cases on our kernels.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstitch
from jaxstitch.frontend import trace
from jaxstitch.integration import transforms
from strategies import force_stitching, random_inputs

S32 = jax.ShapeDtypeStruct


def layernorm(x, w, b):
    m = x.mean(-1, keepdims=True)
    v = jnp.square(x - m).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * w + b


def softmax(x):
    return jax.nn.softmax(x, axis=-1)


def xent(logits, labels):
    """Mean cross-entropy against integer labels (one-hot by comparison: no gather)."""
    logits = logits.astype(jnp.float32)
    onehot = labels[:, None] == jnp.arange(logits.shape[-1])[None, :]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.sum(jnp.where(onehot, logits, 0.0), -1))


def bias_gelu(x, b):
    return jax.nn.gelu(x + b)


def rms_residual(x, r, w):
    h = x + r
    return h * jax.lax.rsqrt(jnp.mean(jnp.square(h.astype(jnp.float32)), -1, keepdims=True) + 1e-6).astype(h.dtype) * w, h


FUNS = {  # name -> (function, input specs; float inputs take the test's dtype)
    "layernorm": (layernorm, [S32((256, 1024), jnp.float32), S32((1024,), jnp.float32), S32((1024,), jnp.float32)]),
    "softmax": (softmax, [S32((512, 384), jnp.float32)]),
    "xent": (xent, [S32((128, 2048), jnp.float32), S32((128,), jnp.int32)]),
    "bias_gelu": (bias_gelu, [S32((512, 768), jnp.float32), S32((768,), jnp.float32)]),
    "rms_residual": (rms_residual, [S32((256, 512), jnp.float32)] * 2 + [S32((512,), jnp.float32)]),
}


def scalar(out):
    """A scalar of every float output: squares with fixed, uneven, positive weights. (A softmax's plain
    sum has no gradient; a sum of terms of both signs cancels, so bfloat16 roundings of the terms
    moved it by 16% on a GPU.)"""
    total = 0.0
    for o in jax.tree.leaves(out):
        if jnp.issubdtype(o.dtype, jnp.floating):
            w = 1.5 + jnp.cos(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape))
            total = total + jnp.sum(jnp.square(o.astype(jnp.float32)) * w)
    return total


def _floats(args):
    return tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))


def _tangents(args):
    return [a * 0.5 + 0.25 for a in args if jnp.issubdtype(a.dtype, jnp.floating)]


def _partial_floats(f, args):
    """f of its float arguments only (the others fixed to `args`' values)."""
    fl = _floats(args)

    def g(*floats):
        full = list(args)
        for i, v in zip(fl, floats):
            full[i] = v
        return f(*full)

    return g, [args[i] for i in fl]


# composition name -> (wrap, f, args) -> callable of no arguments. `wrap` is jaxstitch.jit or the
# identity (the reference).
COMPOSITIONS = {
    "grad": lambda wrap, f, args: lambda: jax.grad(lambda *a: scalar(wrap(f)(*a)), _floats(args))(*args),
    "jit_of_grad": lambda wrap, f, args: lambda: wrap(jax.grad(lambda *a: scalar(f(*a)), _floats(args)))(*args),
    "value_and_grad_in_jit": lambda wrap, f, args: lambda: jax.jit(
        jax.value_and_grad(lambda *a: scalar(wrap(f)(*a)), _floats(args)))(*args),
    "vmap": lambda wrap, f, args: lambda: jax.vmap(wrap(f), in_axes=(0,) + (None,) * (len(args) - 1))(
        jnp.stack([args[0], args[0] * 0.5 + 1.0]), *args[1:]),
    "grad_of_vmap": lambda wrap, f, args: lambda: jax.grad(lambda x: scalar(jax.vmap(
        wrap(f), in_axes=(0,) + (None,) * (len(args) - 1))(x, *args[1:])))(jnp.stack([args[0], args[0] + 1.0])),
    "jvp": lambda wrap, f, args: lambda: jax.jvp(_partial_floats(wrap(f), args)[0],
                                                 _partial_floats(f, args)[1], _tangents(args)),
    "linearize": lambda wrap, f, args: lambda: (lambda out, lin: (out, lin(*_tangents(args))))(
        *jax.linearize(_partial_floats(wrap(f), args)[0], *_partial_floats(f, args)[1])),
    "checkpoint_grad": lambda wrap, f, args: lambda: jax.grad(
        jax.checkpoint(lambda *a: scalar(wrap(f)(*a))), _floats(args))(*args),
    "hvp": lambda wrap, f, args: lambda: jax.jvp(
        jax.grad(lambda *a: scalar(_partial_floats(wrap(f), args)[0](*a)), tuple(range(len(_floats(args))))),
        _partial_floats(f, args)[1], _tangents(args)),
}
# Second derivatives cancel more: op-by-op float32 (as ours, unfused on a CPU) is ~1e-4 of the scale
# from float64 on the bias+GELU's, where XLA's fused CPU code is ~1e-5; and a small output (the
# layernorm's d/dw, max 1.5e-4) carries the others' roundoff (~1e-6 from float64 on both sides), so
# its scale is that of all outputs.
RTOL = {"hvp": 5e-4}
GLOBAL_SCALE = {"hvp"}
# the least number of stitched kernels each composition's program must hold
MIN_KERNELS = {"grad": 2, "value_and_grad_in_jit": 2, "grad_of_vmap": 2, "checkpoint_grad": 2, "hvp": 2}


def stitch_eqns(closed):
    """The `stitch` equations anywhere in a (closed) jaxpr, nested jaxprs and bodies included."""
    for eqn in getattr(closed, "jaxpr", closed).eqns:
        if eqn.primitive.name == "jaxstitch_stitch":
            yield eqn
            continue
        for v in eqn.params.values():
            for item in (v if isinstance(v, (tuple, list)) else (v,)):
                if hasattr(item, "eqns") or hasattr(getattr(item, "jaxpr", None), "eqns"):
                    yield from stitch_eqns(item)


def stitched_kernels(closed) -> int:
    """`stitch` equations with a kernel anywhere in a (closed) jaxpr, bodies included."""
    return sum(eqn.params["launch"] is not None for eqn in stitch_eqns(closed))


def _cpu_stitch(f):
    return jaxstitch.jit(f, target="h100")


def _args(name, seed=0):
    return random_inputs(FUNS[name][1], seed)


def _scale(w) -> float:
    w = np.asarray(w)
    return max(float(np.max(np.abs(w.astype(np.float64)))), 1e-30) if w.size and w.dtype != jax.dtypes.float0 else 0.0


def _check_close(got, want, rtol=2e-5, global_scale=False):
    overall = max(_scale(w) for w in jax.tree.leaves(want))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype
        if g.dtype == jax.dtypes.float0:
            continue
        scale = overall if global_scale else max(_scale(w), 1e-30)
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=0, atol=rtol * scale)


@pytest.mark.parametrize("comp", sorted(COMPOSITIONS))
@pytest.mark.parametrize("name", sorted(FUNS))
def test_compositions_match_jax_and_stay_stitched(name, comp):
    f, _ = FUNS[name]
    args = _args(name)
    make = COMPOSITIONS[comp]
    with force_stitching():
        got_fn = make(_cpu_stitch, f, args)
        kernels = stitched_kernels(jax.make_jaxpr(got_fn)())
        got = got_fn()
    want = jax.jit(make(lambda g: g, f, args))()
    _check_close(got, want, RTOL.get(comp, 2e-5), comp in GLOBAL_SCALE)
    assert kernels >= MIN_KERNELS.get(comp, 1), f"{name} under {comp}: {kernels} stitched kernels"


def test_grad_stitches_the_forward_and_the_backward_apart():
    """grad(jaxstitch.jit(layernorm)): one forward kernel, whose residuals are the row statistics (not
    the normalised rows), and one backward kernel reading x again."""
    f, _ = FUNS["layernorm"]
    args = _args("layernorm")
    with force_stitching():
        closed = jax.make_jaxpr(jax.grad(lambda *a: scalar(_cpu_stitch(f)(*a)), (0, 1, 2)))(*args)
    stitches = list(stitch_eqns(closed))
    assert len(stitches) == 2 and all(e.params["launch"] is not None for e in stitches)
    fwd, bwd = stitches
    full = [v for v in fwd.outvars if v.aval.shape == (256, 1024)]
    assert len(full) == 1, "the forward kernel writes only y at full size"
    assert sorted(v.aval.shape for v in bwd.outvars) == sorted([(1024,), (1024,), (256, 1024)])


def test_unzip_keeps_reduced_residuals_and_recomputes_full_ones():
    """The JVP's known part gives the linear part inputs, results and reduced values; a full-size
    intermediate (x - mean) is computed again on the linear side."""
    f, specs = FUNS["layernorm"]
    n = len(specs)

    def jvp_fun(*a):
        p, t = jax.jvp(f, a[:n], a[n:])
        return [p, t]

    avals = specs + specs
    traced = trace.trace(jvp_fun, avals, trace.positional_tree(avals))
    parts = transforms.unzip(traced, [False] * n + [True] * n)
    inputs = {v.id for v in traced.graph.inputs}
    outputs = {a.id for a in traced.graph.outputs}
    for r in parts.residuals:
        assert r.id in inputs or r.id in outputs or r.size < 256 * 1024, r
    assert any(r.id == traced.graph.inputs[0].id for r in parts.residuals), "x is a residual"
    assert parts.unknown_outputs == (False, True)
    assert set(map(id, parts.known_eqns)) & set(map(id, parts.linear_eqns)), \
        "the linear side recomputes some known full-size values"
    # and the split computes what the whole does
    args = random_inputs(specs + specs, 3)
    known = parts.known(*args[:n])
    lin = parts.linear(*known[1:], *args[n:])
    want = jvp_fun(*args)
    _check_close([known[0], lin[0]], want)


# ---------------------------------------------------------------------------------------------------
# control flow
# ---------------------------------------------------------------------------------------------------

def gru_scan(h0, xs, w):
    """A GRU-like cell over a sequence: the cell's elementwise and normalising work is one region."""
    def cell(h, x):
        z = jax.nn.sigmoid(x @ w + h)
        hn = (1 - z) * h + z * jnp.tanh(x)
        hn = hn - hn.mean(-1, keepdims=True)
        return hn, jax.nn.softmax(hn, -1)

    return jax.lax.scan(cell, h0, xs)


def gru_scan_grad(h0, xs, w):
    return jax.grad(lambda h0, w: scalar(gru_scan(h0, xs, w)), (0, 1))(h0, w)


def while_softmax(x):
    body = lambda c: (jax.nn.softmax(c[0] * 1.5, -1) * c[0] + c[0], c[1] + 1)  # noqa: E731
    return jax.lax.while_loop(lambda c: c[1] < 3, body, (x, 0))[0]


def fori_layernorm(x, w, b):
    return jax.lax.fori_loop(0, 3, lambda i, y: layernorm(y, w, b) + x, x)


def cond_norm(p, x):
    return jax.lax.cond(p > 0, lambda x: jax.nn.softmax(x, -1), lambda x: jax.nn.log_softmax(x, -1), x)


CONTROL_FLOW = {  # name -> (function, specs, label of the body that must hold a stitched region)
    "scan_gru": (gru_scan, [S32((64, 128), jnp.float32), S32((10, 64, 128), jnp.float32),
                            S32((128, 128), jnp.float32)], "scan"),
    "scan_gru_grad": (gru_scan_grad, [S32((64, 128), jnp.float32), S32((10, 64, 128), jnp.float32),
                                      S32((128, 128), jnp.float32)], "scan"),
    "while_softmax": (while_softmax, [S32((256, 512), jnp.float32)], "while.body_jaxpr"),
    "fori_layernorm": (fori_layernorm, FUNS["layernorm"][1], None),
    "cond_softmax": (cond_norm, [S32((), jnp.float32), S32((256, 512), jnp.float32)], "cond.branches[1]"),
}


@pytest.mark.parametrize("name", sorted(CONTROL_FLOW))
def test_control_flow_bodies_are_stitched(name, monkeypatch):
    """Regions inside loop bodies (scans planned as loops: scans=0; whole scans as one kernel are
    tests/test_persistent_scans.py's)."""
    monkeypatch.setenv("JAXSTITCH_TUNE", "scans=0")
    f, specs, where = CONTROL_FLOW[name]
    args = random_inputs(specs, 1)
    with force_stitching():
        report = jaxstitch.explain(f, *args, target="h100")
        body = [r for r in report.regions if r.where and r.stitched]
        assert body, str(report)
        if where is not None:
            assert any(r.where == where for r in body), str(report)
        assert "control flow" in str(report)
        kernels = stitched_kernels(jax.make_jaxpr(_cpu_stitch(f))(*args))
        got = _cpu_stitch(f)(*args)
    assert kernels >= len(body)
    _check_close(got, jax.jit(f)(*args))


def test_a_body_without_stitched_regions_is_left_as_it_was(monkeypatch):
    """A scan whose body the cost model declines keeps its original body jaxpr (planned as a loop:
    scans=0)."""
    monkeypatch.setenv("JAXSTITCH_TUNE", "scans=0")
    def f(xs):
        return jax.lax.scan(lambda c, x: (c + x, x * 2.0), jnp.zeros(xs.shape[1:]), xs)

    xs = random_inputs([S32((4, 8), jnp.float32)], 2)[0]
    plain = jax.make_jaxpr(jax.jit(f))(xs)
    ours = jax.make_jaxpr(_cpu_stitch(f))(xs)
    assert stitched_kernels(ours) == 0
    assert str(plain).count("scan[") == str(ours).count("scan[") == 1
    _check_close(_cpu_stitch(f)(xs), jax.jit(f)(xs))


# ---------------------------------------------------------------------------------------------------
# Flax NNX
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("guard", [False, True])
def test_nnx_jit_updates_modules_and_optimizer_in_place_like_nnx_jit(guard):
    """jaxstitch.nnx.jit of a train step (dropout RNG counters, AdamW state, parameters updated in
    place) gives nnx.jit's losses and parameters, step after step; the guard's timed calls (on the
    first step's inputs) change none of them."""
    optax = pytest.importorskip("optax")
    nnx = pytest.importorskip("flax.nnx")
    import jaxstitch.nnx

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(64, 128, rngs=rngs)
            self.ln = nnx.LayerNorm(128, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.l2 = nnx.Linear(128, 10, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(jax.nn.gelu(self.ln(self.l1(x)))))

    def step(model, optimizer, x, y):
        def loss_fn(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    x = random_inputs([S32((256, 64), jnp.float32)], 4)[0]
    y = jax.random.randint(jax.random.key(2), (256,), 0, 10)
    runs = []
    for wrap in (nnx.jit, jaxstitch.nnx.jit(target="h100", guard=guard)):
        model = Mlp(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        f = wrap(step)
        with force_stitching():
            losses = [float(f(model, optimizer, x, y)) for _ in range(4)]
        runs.append((losses, jax.tree.leaves(nnx.state(model, nnx.Param))))
    (want, want_params), (got, got_params) = runs
    assert len(set(want)) == 4, "the losses move from step to step"
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _check_close(got_params, want_params, 1e-5)


# Stitched regions at the QUICK sizes: 115, 66, 96 now (equal equations merged first, cse.py: DIEN's
# 105 regions of 824 ops were 96 of 797, the same ops computed once).
MIN_EXAMPLE_REGIONS = {"bert_train": 105, "gpt_train": 60, "dien_train": 90}


@pytest.mark.parametrize("example", list(MIN_EXAMPLE_REGIONS))
def test_training_examples_run_and_match_jax_jit(example):
    """examples/*_train.py at their tiny sizes, planned for an H100 with every region stitched (run
    here through the regions' XLA fallback): both compilers train to the same losses."""
    pytest.importorskip("optax")
    import functools
    import importlib
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    module = importlib.import_module(example)
    import train_harness

    c = module.QUICK
    graphdef, state = module.make_init(c, 0)()
    with force_stitching():
        report = jaxstitch.explain(module.train_step, graphdef, state, module.make_batches(c, 0)(0),
                                   target="h100")
        assert sum(r.stitched for r in report.regions) >= MIN_EXAMPLE_REGIONS[example]
        if example == "dien_train":  # its four GRU scans (two forward, two backward), each one kernel
            assert sum(r.stitched for r in report.regions if r.ops == ("scan",)) == 4, str(report)
        assert train_harness.compare(f"tiny {example}", module.train_step, module.make_init(c, 0),
                                     module.make_batches(c, 0), steps=4, rtol=1e-5,
                                     stitch_jit=functools.partial(jaxstitch.jit, target="h100"))
    import gc
    assert gc.isenabled(), "the harness turns the collector off while timing, and back on after"


def test_the_harness_reports_the_rounds_spread():
    """A run's step time is its rounds' median and its spread their range over it."""
    pytest.importorskip("optax")
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import train_harness

    r = train_harness.Run("x", [1.0], 10.0, 1.0, None, None, round_ms=[9.0, 10.0, 12.0])
    assert r.spread_pct == pytest.approx(30.0)
    assert train_harness.Run("x", [1.0], 10.0, 1.0, None, None, round_ms=[10.0]).spread_pct == 0.0
