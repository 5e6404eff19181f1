"""The program guard (jaxstitch/integration/guard.py) on the CPU: what it measures, what it keeps, and where it
stays out of the way. Planned for an H200, the stitched regions run through XLA here, so the two
programs' speeds are XLA's both; `_timed_call` is replaced where a test needs one to lose."""
import gc
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstitch
from jaxstitch.integration import guard
from strategies import force_stitching


@pytest.fixture(autouse=True)
def _own_decisions(tmp_path, monkeypatch):
    """Each test its own kernel cache, so no decision remembered on disk carries over."""
    monkeypatch.setenv("JAXSTITCH_CACHE_DIR", str(tmp_path))


def softmax_times(x, y):
    return jax.nn.softmax(x * 2.0, axis=-1) * y


def _inputs(seed=0, shape=(64, 256)):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, shape), jax.random.normal(ky, shape)


def _slower(loser: str, monkeypatch):
    """Make `loser` (guard.STITCHED or guard.XLA) measure 1 ms a call, the other 0.5 ms; returns the
    inputs each timed call got."""
    seen = []

    def timed_call(fn, args, kwargs, which):
        seen.append((which, args, kwargs))
        jax.block_until_ready(fn(*args, **kwargs))
        return 1.0 if which == loser else 0.5

    monkeypatch.setattr(guard, "_timed_call", timed_call)
    return seen


@pytest.mark.parametrize("loser", [guard.STITCHED, guard.XLA])
def test_keeps_the_faster_program_and_routes_later_calls_to_it(loser, monkeypatch):
    _slower(loser, monkeypatch)
    with force_stitching():
        f = jaxstitch.jit(softmax_times, target="h200", guard=True)
        x, y = _inputs()
        first = f(x, y)
    (decision,) = f.guard_decisions
    winner = guard.XLA if loser == guard.STITCHED else guard.STITCHED
    assert decision.choice == winner and decision.calls >= guard.MIN_CALLS
    assert (decision.stitched_ms, decision.xla_ms) == ((1.0, 0.5) if winner == guard.XLA else (0.5, 1.0))
    x2, y2 = _inputs(1)
    want = jax.jit(softmax_times)(x2, y2)
    np.testing.assert_allclose(f(x2, y2), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(first, jax.jit(softmax_times)(x, y), rtol=1e-6, atol=1e-6)
    # the shapes already decided are not measured again; jax.jit's program ran only if it won
    assert len(f.guard_decisions) == 1
    assert (f._xla._cache_size() > 0) and bool(f._xla_keys) == (winner == guard.XLA)


def test_a_new_set_of_shapes_is_measured_on_its_own(monkeypatch):
    _slower(guard.STITCHED, monkeypatch)
    with force_stitching():
        f = jaxstitch.jit(softmax_times, target="h200", guard=True)
        f(*_inputs())
        f(*_inputs(shape=(32, 128)))
    assert [d.choice for d in f.guard_decisions] == [guard.XLA, guard.XLA]
    assert len(f._xla_keys) == 2


def test_donated_arguments_are_copied_for_each_timed_call(monkeypatch):
    seen = _slower(guard.XLA, monkeypatch)
    with force_stitching():
        f = jaxstitch.jit(softmax_times, target="h200", guard=True, donate_argnums=0)
        x, y = _inputs()
        f(x, y)
    assert seen and all(args[0] is not x and args[1] is y for _, args, _ in seen)


def test_measured_for_real_on_this_machine():
    with force_stitching():
        f = jaxstitch.jit(softmax_times, target="h200", guard=True)
        f(*_inputs())
    (d,) = f.guard_decisions
    assert d.stitched_ms > 0 and d.xla_ms > 0 and guard.MIN_CALLS <= d.calls <= guard.MAX_CALLS
    assert str(d).startswith("(float32[64, 256], float32[64, 256]; 2 arrays): ")


def test_no_measuring_under_a_transformation_with_effects_or_without_kernels(monkeypatch):
    seen = _slower(guard.STITCHED, monkeypatch)
    with force_stitching():
        f = jaxstitch.jit(softmax_times, target="h200", guard=True)
        x, y = _inputs()
        g = jax.grad(lambda x: f(x, y).sum())(x)
        assert f.guard_decisions == [] and g.shape == x.shape
        assert f._xla_compile is None  # (nor does jax.jit's program start compiling beside it)

        def printing(x, y):
            jax.debug.print("{}", x[0, 0])
            return softmax_times(x, y)

        p = jaxstitch.jit(printing, target="h200", guard=True)
        p(x, y)
    assert [d.why for d in p.guard_decisions] == ["the program has side effects, which timed calls would repeat"]
    tiny = jaxstitch.jit(lambda x: x + 1, target="h200", guard=True)
    tiny(jnp.ones(4))
    assert [d.choice for d in tiny.guard_decisions] == [guard.STITCHED]
    assert "no stitched kernel" in tiny.guard_decisions[0].why
    assert not seen


def test_off_by_switch_and_without_a_gpu(monkeypatch):
    monkeypatch.delenv("JAXSTITCH_GUARD")  # (conftest turns it off for the other tests)
    assert not isinstance(jaxstitch.jit(softmax_times, target="h200", guard=False), guard.Guarded)
    if not any(d.platform == "gpu" for d in jax.devices()):  # (default: on only where kernels run)
        assert not isinstance(jaxstitch.jit(softmax_times, target="h200"), guard.Guarded)
    monkeypatch.setenv("JAXSTITCH_GUARD", "1")
    assert isinstance(jaxstitch.jit(softmax_times, target="h200"), guard.Guarded)
    monkeypatch.setenv("JAXSTITCH_GUARD", "0")
    assert not isinstance(jaxstitch.jit(softmax_times, target="h200"), guard.Guarded)


def test_the_guarded_function_is_a_jitted_function():
    """`lower` and static arguments work as on jax.jit's functions."""
    f = jaxstitch.jit(lambda x, n: x * n, target="h200", guard=True, static_argnums=1)
    assert "mul" in f.lower(jnp.ones(3), 2).as_text()
    assert float(f(jnp.ones(3), 2)[0]) == 2.0



@pytest.mark.parametrize("winner", [guard.STITCHED, guard.XLA])
def test_a_decision_is_remembered_on_disk_for_the_same_program(winner, monkeypatch):
    seen = _slower(guard.XLA if winner == guard.STITCHED else guard.STITCHED, monkeypatch)
    x, y = _inputs()
    with force_stitching():
        first = jaxstitch.jit(softmax_times, target="h200", guard=True)
        first(x, y)
        measured = len(seen)
        again = jaxstitch.jit(softmax_times, target="h200", guard=True)  # (a later process's, as far
        got = again(x, y)                                                # as the disk goes)
        donating = jaxstitch.jit(softmax_times, target="h200", guard=True, donate_argnums=1)
        donating(x, jnp.copy(y))
    (d,) = again.guard_decisions
    assert measured and len(seen) == 2 * measured  # (again: none; donating, other options: measured)
    assert d.choice == winner and d.why == "remembered on disk" and d.calls == first.guard_decisions[0].calls
    assert not again._xla_keys  # (jax.jit's program is what `again` traced, where it won:)
    with force_stitching():
        traced = str(jax.make_jaxpr(again._stitched)(x, y))
    assert ("jaxstitch_stitch" in traced) == (winner == guard.STITCHED)
    np.testing.assert_allclose(got, jax.jit(softmax_times)(x, y), rtol=1e-6, atol=1e-6)
    assert [p.name.startswith("decision-") for p in
            (__import__("pathlib").Path(os.environ["JAXSTITCH_CACHE_DIR"]) / guard.DECISIONS_DIR).iterdir()] == [True, True]


@pytest.mark.parametrize("committed", [False, True])
def test_jax_jits_program_compiles_beside_the_trace_and_its_call_finds_it(committed):
    """Lowered from the call's own arrays (committed to a device or not), compiled in a thread:
    the jitted function's call after it compiles nothing more."""
    from jax import monitoring

    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiles.append(event) if "backend_compile" in event else None)
    xla = jax.jit(lambda x, y, k: jnp.cos(x) * y + k, static_argnums=2, donate_argnums=0)
    x, y = _inputs(shape=(128, 96))
    if committed:
        x, y = jax.device_put(x, jax.devices()[0]), jax.device_put(y, jax.devices()[0])
    started = []

    def traced(a, b):
        started.append(guard._compile_beside(xla, (x, y, 3), {}))
        return a + b

    jax.jit(traced)(x, y)
    started[0].result()
    before = len(compiles)
    xla(x, y, 3)
    assert len(compiles) == before


@pytest.mark.parametrize("stitched_ms, xla_ms, choice", [
    ([1.00, 1.01, 1.02], [0.99, 1.00, 1.01], guard.STITCHED),   # 1% apart: a tie keeps ours
    ([1.10, 1.10, 1.10], [1.00, 1.00, 1.20], guard.XLA),        # 9% apart, its fastest faster too
    ([1.10, 1.10, 0.90], [1.00, 1.00, 1.00], guard.STITCHED),   # its median lower, not its fastest
    ([1.00, 1.00, 1.00], [1.10, 1.10, 1.10], guard.STITCHED)])
def test_jax_jit_is_chosen_only_beyond_the_noise(stitched_ms, xla_ms, choice):
    d = guard._decision(stitched_ms, xla_ms, "shapes")
    assert d.choice == choice and d.calls == 3
    assert ("a tie" in d.why) == (choice == guard.STITCHED and sorted(xla_ms)[1] < sorted(stitched_ms)[1])


def test_donated_arguments_get_copies_or_zeros_where_given_up():
    x, y, z = (jnp.full((3, 4), v) for v in (1.0, 2.0, 3.0))
    y.delete()
    fresh = guard._fresh_buffers([x, y, z, 7], frozenset({0, 1}))()
    assert sorted(fresh) == [0, 1] and fresh[0] is not x
    np.testing.assert_array_equal(fresh[0], x)
    np.testing.assert_array_equal(fresh[1], np.zeros((3, 4), np.float32))


def test_timed_calls_run_with_the_garbage_collector_paused(monkeypatch):
    collecting = []

    def timed_call(fn, args, kwargs, which):
        collecting.append(gc.isenabled())
        jax.block_until_ready(fn(*args, **kwargs))
        return 1.0

    monkeypatch.setattr(guard, "_timed_call", timed_call)
    with force_stitching():
        f = jaxstitch.jit(softmax_times, target="h200", guard=True)
        f(*_inputs())
    assert collecting and not any(collecting) and gc.isenabled()


@pytest.mark.parametrize("committed", [False, True])
def test_the_timed_calls_compile_nothing_more(committed):
    """The copies of donated arguments are placed as the user's were (committed to a device or not):
    jit keys its executables by placement, and copies placed otherwise compiled both programs again
    (43 s for BERT's step on an H200)."""
    from jax import monitoring

    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiles.append(event) if "backend_compile" in event else None)
    x, y = _inputs(shape=(64, 320))
    if committed:
        x, y = jax.device_put((x, y), jax.devices()[0])
    with force_stitching():
        f = jaxstitch.jit(softmax_times, target="h200", guard=True, donate_argnums=0)
        before = len(compiles)
        f(x, y)
    assert f.guard_decisions[0].stitched_ms is not None
    assert len(compiles) - before == 3  # the stitched program, jax.jit's beside it, the copies' function
    assert guard._fresh_buffers([x, y], frozenset({0}))()[0].committed == committed
