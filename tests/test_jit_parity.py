"""`jaxstitch.jit` and `jaxstitch.nnx.jit` behave like `jax.jit` and `flax.nnx.jit`: the same parameters
and value forms, the same donation, errors that name the user's function and arguments, tracebacks
without jaxstitch's frames, and GPU targets named exactly or by a documented alias. CPU-only:
`target="h100"` takes the stitching path here (its regions then run through XLA)."""
from __future__ import annotations

import inspect
import os
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstitch
from jaxstitch import targets
from jaxstitch.integration import devices
from jaxstitch.api import _argnums_and_names, _donated_positions

TARGET = "h100"
X = jax.random.normal(jax.random.key(0), (64, 128), jnp.float32)


def softmax_of(x, y, unused):
    return jax.nn.softmax(jnp.tanh(x) * y, axis=-1)


def _both(fun, **options):
    """(jax.jit, jaxstitch.jit) of `fun` with the same options."""
    return jax.jit(fun, **options), jaxstitch.jit(fun, target=TARGET, **options)


# ---------------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------------

def test_every_jax_jit_parameter_is_accepted():
    ours = inspect.signature(jaxstitch.jit).parameters
    missing = [p for p in inspect.signature(jax.jit).parameters if p != "fun" and p not in ours]
    assert not missing, f"jaxstitch.jit lacks jax.jit's {missing}"
    assert "target" in ours


def _softmax(x):
    return jax.nn.softmax(x, axis=-1)


def test_tuning_overrides_the_environment_for_one_function(monkeypatch):
    """`tuning=` plans this function with those overrides, whatever JAXSTITCH_TUNE says, in `jit`
    (the configuration its builds get) and in `explain` (the plan it reports)."""
    from jaxstitch.integration import families

    monkeypatch.setenv("JAXSTITCH_TUNE", "max_tpr=64")
    seen = []
    build = families.build_any
    monkeypatch.setattr(families, "build_any", lambda *a, **k: seen.append(a[4].tuning) or build(*a, **k))
    x = jnp.ones((64, 4096), jnp.float32)
    jaxstitch.jit(_softmax, target=TARGET, guard=False, tuning="max_tpr=128,online=0")(x)
    jaxstitch.jit(_softmax, target=TARGET, guard=False)(x)
    assert [(t.max_tpr, t.online) for t in seen] == [(128, 0), (64, 1)]
    small = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    forced = jaxstitch.explain(_softmax, small, target=TARGET, tuning=jaxstitch.core.config.Tuning(min_gain_pct=0))
    default = jaxstitch.explain(_softmax, small, target=TARGET)
    assert forced.stitched_kernels == 1 and default.stitched_kernels == 0, (forced, default)


@pytest.mark.parametrize("tuning, error", [("max_tpr=3", ValueError), ("bogus=1", ValueError), (128, TypeError),
                                           (jaxstitch.core.config.Tuning(stages=9), ValueError)], ids=str)
def test_a_bad_tuning_is_refused_naming_the_argument(tuning, error):
    with pytest.raises(error, match="jaxstitch.jit: argument `tuning`"):
        jaxstitch.jit(_softmax, target=TARGET, tuning=tuning)


@pytest.mark.parametrize("options", [
    dict(keep_unused=True), dict(inline=True), dict(static_argnames="unused"), dict(static_argnums=2),
    dict(donate_argnames="y"), dict(donate_argnames=["x", "y"]), dict(donate_argnums=[1]),
    dict(compiler_options={}),
], ids=str)
def test_options_give_jax_jits_results(options):
    third = 3 if "static" in str(options) else X
    want = jax.jit(softmax_of)(X, X, X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (donated buffers the program cannot reuse)
        for f in _both(softmax_of, **options):
            np.testing.assert_allclose(f(X + 0, X + 0, third), want, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(f(X + 0, y=X + 0, unused=third), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("options", [dict(device="cpu0"), dict(backend="cpu")], ids=str)
def test_device_and_backend_are_passed_on(options):
    """Deprecated in jax.jit (a DeprecationWarning), and honoured: the program runs there."""
    if options.get("device") == "cpu0":
        options = dict(device=jax.devices("cpu")[0])
    with pytest.warns(DeprecationWarning, match="backend and device"):
        out = jaxstitch.jit(softmax_of, target=TARGET, **options)(X, X, X)
    assert out.devices() == {jax.devices("cpu")[0]}
    np.testing.assert_allclose(out, jax.jit(softmax_of)(X, X, X), rtol=1e-5, atol=1e-6)


def _main_arguments(lowered) -> int:
    main = next(line for line in lowered.as_text().splitlines() if "func.func public @main" in line)
    return main.count("%arg")


@pytest.mark.parametrize("keep_unused", [False, True])
def test_keep_unused_keeps_the_unused_argument_like_jax_jit(keep_unused):
    theirs, ours = _both(softmax_of, keep_unused=keep_unused)
    want = _main_arguments(theirs.lower(X, X, X))
    assert want == (3 if keep_unused else 2)
    assert _main_arguments(ours.lower(X, X, X)) == want


@pytest.mark.parametrize("options", [
    dict(donate_argnums=1), dict(donate_argnums=(1,)), dict(donate_argnames="y"), dict(donate_argnames=("y",)),
    dict(donate_argnums=-1), dict(donate_argnums=(0,), donate_argnames=()),
], ids=str)
@pytest.mark.parametrize("by_keyword", [False, True])
def test_donation_deletes_what_jax_jit_deletes(options, by_keyword):
    """Whether x and y are deleted after the call, passed by position or by keyword: jax.jit resolves
    names and positions through the signature (a negative position donates nothing)."""
    deleted = []
    for f in _both(softmax_of, **options):
        x, y = X + 0, X + 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            f(x, y=y, unused=X) if by_keyword else f(x, y, X)
        deleted.append((x.is_deleted(), y.is_deleted()))
    assert deleted[1] == deleted[0]


def test_donated_names_and_positions_follow_the_signature():
    def f(a, b, /, c, d=1, *rest, e, **kw):
        pass

    assert _argnums_and_names(f, None, None, "donate", "who") == ((), ())
    assert _argnums_and_names(f, 2, None, "donate", "who") == ((2,), ("c",))
    assert _argnums_and_names(f, [0, 3], None, "donate", "who") == ((0, 3), ("d",))
    assert _argnums_and_names(f, None, "c", "donate", "who") == ((2,), ("c",))
    assert _argnums_and_names(f, None, ["d", "e"], "donate", "who") == ((3,), ("d", "e"))  # (e: keyword only)
    assert _argnums_and_names(f, (0,), ("e",), "donate", "who") == ((0,), ("e",))  # (both given: as given)
    with pytest.raises(TypeError, match="donate_argnums"):
        _argnums_and_names(f, "c", None, "donate", "jaxstitch.jit")
    with pytest.raises(TypeError, match="donate_argnames"):
        jaxstitch.jit(f, donate_argnames=3, target=TARGET)
    with pytest.raises(ValueError, match="donate_argnames"):  # (jax.jit's check, made by ours too)
        jax.jit(softmax_of, donate_argnames="nope")
    with pytest.raises(ValueError, match="donate_argnames"):
        jaxstitch.jit(softmax_of, donate_argnames="nope", target=TARGET)


def test_donated_keyword_arguments_reach_the_runner():
    """The runner's donated positions (its kernels may write over them) include keyword arguments."""
    x = jnp.ones(3)
    args, kwargs = ({"a": x, "b": 2}, x), {"k": x, "j": [x, x]}  # (leaves: a, x, then j, j, k)
    assert _donated_positions(args, kwargs, (), ("k",)) == {4}
    assert _donated_positions(args, kwargs, (1,), ("j",)) == {1, 2, 3}
    assert _donated_positions(args, kwargs, None, "k") == {4}


# ---------------------------------------------------------------------------------------------------
# Errors name the user's function and arguments; tracebacks show the user's frames
# ---------------------------------------------------------------------------------------------------

def branches_on(params, x, *more, scale=1.0):
    if params["w"][1].sum() > 0:
        return x * scale
    return x


def concrete_int(a, b):
    return jnp.zeros(int(b))


def bad_product(x, y):
    return x @ y


ERROR_CASES = {
    "bool of a nested argument": (branches_on, ({"w": [X, X]}, X), {}),
    "bool, keyword arguments": (branches_on, ({"w": [X, X]}, X), {"scale": 2.0}),
    "bool, *args": (lambda *args: branches_on(*args), ({"w": [X, X]}, X, X), {}),
    "int of an argument": (concrete_int, (X, jnp.float32(3)), {}),
    "int, keyword": (concrete_int, (X,), {"b": jnp.float32(3)}),
    "shapes": (bad_product, (X, X), {}),
}


def _message(f, args, kwargs) -> str:
    with pytest.raises(Exception) as info:
        f(*args, **kwargs)
    return f"{type(info.value).__name__}: {info.value}"


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_read_as_jax_jits(case):
    fun, args, kwargs = ERROR_CASES[case]
    theirs, ours = (_message(f, args, kwargs) for f in _both(fun))
    assert ours == theirs
    assert "jaxstitch" not in ours and "flat_fun" not in ours


def test_a_tracer_error_names_the_function_and_the_argument_path():
    msg = _message(jaxstitch.jit(branches_on, target=TARGET), ({"w": [X, X]}, X), {})
    assert f"branches_on at {__file__}:{branches_on.__code__.co_firstlineno}" in msg
    assert "argument params['w'][1]" in msg


def _frames(exc) -> list[str]:
    return [f.filename for f in traceback.extract_tb(exc.__traceback__)]


def test_tracebacks_hide_jaxstitch_frames():
    """With JAX_TRACEBACK_FILTERING's default, the traceback jax leaves on an error in the user's
    function has its frames and none of jaxstitch's (which are there unfiltered)."""
    package = os.path.dirname(os.path.abspath(jaxstitch.__file__))

    def ours(frames):
        return [f for f in frames if os.path.abspath(f).startswith(package + os.sep)]

    f = jaxstitch.jit(bad_product, target=TARGET)
    with pytest.raises(TypeError) as info:
        f(X, X)
    assert __file__ in _frames(info.value)
    assert not ours(_frames(info.value)), ours(_frames(info.value))
    before = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", "off")
    try:
        with pytest.raises(TypeError) as unfiltered:
            jaxstitch.jit(bad_product, target=TARGET)(X, X)
    finally:
        jax.config.update("jax_traceback_filtering", before)
    assert ours(_frames(unfiltered.value)), "the test would not see jaxstitch's frames"


# ---------------------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, want", [
    ("h100", "h100"), ("h200", "h200"), ("a100", "a100"), ("H100", "h100"), ("nvidia-h100", "h100"),
    ("NVIDIA H100", "h100"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100"),
    ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A100-PCIE-40GB", "a100"),
])
def test_targets_by_name_and_alias(name, want):
    assert targets.get_target(name).name == want
    assert jaxstitch.jit(lambda x: x * 2, target=name)(X).shape == X.shape


@pytest.mark.parametrize("name", ["h1000", "a100x", "h10", "gh200", "tpu9", "", "nvidia", "h100x 80GB"])
def test_unknown_targets_are_refused_naming_the_known_ones(name):
    with pytest.raises(ValueError, match="target") as info:
        jaxstitch.jit(lambda x: x, target=name)
    assert "a100, h100, h200" in str(info.value)
    with pytest.raises(ValueError, match="argument `target`"):
        jaxstitch.explain(lambda x: x, X, target=name)


def test_detect_maps_real_device_kinds(monkeypatch):
    class Gpu:
        platform = "gpu"
        compute_capability = "9.0"
        core_count = 132

        def __init__(self, kind):
            self.device_kind = kind

    for kind, want in [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                       ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GH200 480GB", "h200"),
                       ("NVIDIA H800", "NVIDIA H800")]:
        monkeypatch.setattr(jax, "devices", lambda backend=None, kind=kind: [Gpu(kind)])
        assert devices.detect().name == want


def test_an_unknown_gpu_plans_with_the_h100s_numbers_and_says_so(monkeypatch, caplog):
    class Gpu:
        platform, compute_capability, core_count, device_kind = "gpu", "10.0", 148, "NVIDIA B200"

    monkeypatch.setattr(jax, "devices", lambda backend=None: [Gpu()])
    monkeypatch.setattr(devices, "_WARNED", set())
    with caplog.at_level("WARNING", logger="jaxstitch"):
        first, again = devices.detect(), devices.detect()
    assert (first.arch, first.sm_count) == ("sm_100", 148) and first == again
    assert "NVIDIA B200" in first.calibration.source
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "not a GPU it knows" in caplog.records[0].getMessage()


def test_each_target_has_its_own_calibration():
    h100, h200, a100 = (targets.TARGETS[n].calibration for n in ("h100", "h200", "a100"))
    assert "measured on an H100" in h100.source and "measured on an H200" in h200.source and "not measured" in a100.source
    # not measured on an A100: the H100's scaled by the boost clocks, the while loop's iteration kept
    assert a100.gather_ops_per_sm_us == pytest.approx(h100.gather_ops_per_sm_us * 1410 / 1980)
    assert a100.scan_step_us == pytest.approx(h100.scan_step_us * 1980 / 1410)
    assert a100.xla_iteration_us == h100.xla_iteration_us


# ---------------------------------------------------------------------------------------------------
# jaxstitch.nnx.jit
# ---------------------------------------------------------------------------------------------------

def test_nnx_jit_takes_flax_nnx_jits_options():
    nnx = pytest.importorskip("flax.nnx")
    import jaxstitch.nnx

    ours = inspect.signature(jaxstitch.nnx.jit).parameters
    theirs = inspect.signature(nnx.jit).parameters
    assert not [p for p in theirs if p != "fun" and p not in ours]
    assert {name: ours[name].default for name in theirs if name != "fun"} == \
        {name: p.default for name, p in theirs.items() if name != "fun"}
    assert "target" in ours


def _model_and_step():
    nnx = pytest.importorskip("flax.nnx")

    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))

    def step(model, x, scale=1.0):
        model.kernel[...] = model.kernel[...] * scale
        return jnp.tanh(model(x)).sum()

    return model, step


@pytest.mark.parametrize("options, donated", [
    (dict(), False), (dict(donate_argnums=0), True), (dict(donate_argnames="model"), True),
    (dict(donate_argnums=1), False),
], ids=str)
def test_nnx_jit_donates_only_when_asked_like_flax(options, donated):
    nnx = pytest.importorskip("flax.nnx")
    import jaxstitch.nnx

    x = jnp.ones((4, 8))
    for wrap in (nnx.jit(**options), jaxstitch.nnx.jit(target=TARGET, **options)):
        model, step = _model_and_step()
        held = model.kernel[...]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = wrap(step)(model, x + 0, scale=2.0)
        assert held.is_deleted() == donated, wrap
        np.testing.assert_allclose(model.kernel[...], 2 * np.asarray(_model_and_step()[0].kernel[...]))
        assert np.isfinite(float(loss))


def test_nnx_jit_static_and_keyword_arguments():
    nnx = pytest.importorskip("flax.nnx")
    import jaxstitch.nnx

    results = []
    for wrap in (nnx.jit(static_argnames="scale"), jaxstitch.nnx.jit(static_argnames="scale", target=TARGET)):
        model, step = _model_and_step()
        f = wrap(step)
        results.append([float(f(model, jnp.ones((4, 8)), scale=s)) for s in (2.0, 3.0)]
                       + [float(f(model=model, x=jnp.ones((4, 8))))])
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5)


def test_nnx_jit_static_arguments_before_objects():
    nnx = pytest.importorskip("flax.nnx")
    import jaxstitch.nnx

    results = []
    for wrap in (nnx.jit(static_argnums=(0, 2)), jaxstitch.nnx.jit(static_argnums=(0, 2), target=TARGET)):
        model, step = _model_and_step()
        f = wrap(lambda power, model, scale, x: step(model, x ** power, scale=scale))
        results.append([float(f(p, model, 2.0, jnp.full((4, 8), 0.5))) for p in (1, 2)])
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5)


def test_nnx_jit_refuses_what_it_cannot_honour():
    pytest.importorskip("flax.nnx")
    import jaxstitch.nnx

    _, step = _model_and_step()
    with pytest.raises(NotImplementedError, match="in_shardings"):
        jaxstitch.nnx.jit(step, in_shardings=(None,), target=TARGET)
    with pytest.raises(NotImplementedError, match="graph=False"):
        jaxstitch.nnx.jit(step, graph=False, target=TARGET)
    with pytest.raises(ValueError, match="argument `target`"):
        jaxstitch.nnx.jit(step, target="h1000")


def test_nnx_jit_errors_name_the_users_function():
    pytest.importorskip("flax.nnx")
    import jaxstitch.nnx

    model, _ = _model_and_step()

    def branches(model, x):
        if x.sum() > 0:
            return model(x)
        return x

    msg = _message(jaxstitch.nnx.jit(branches, target=TARGET), (model, jnp.ones((4, 8))), {})
    assert f"branches at {__file__}:{branches.__code__.co_firstlineno}" in msg
    assert "argument kept['x']" in msg
