"""Stitched regions under sharding, on the CPU's four host devices (conftest.py).

On a CPU the stitched kernels run through XLA, but every step of the sharded path runs as on a GPU:
the Shardy rule, the partition callback placing factors on the mesh, the region planned again for
one device's shards with collectives after reductions over a split factor. Each test compares with
`jax.jit` on the same sharded inputs and counts the collectives in both compiled programs.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxstitch
from jaxstitch.bench.runner import count_collectives
from jaxstitch.frontend import trace as trace_mod
from jaxstitch.integration.spmd import factors as factors_mod, lowering as spmd_lowering, placement as placement_mod
from jaxstitch.bench.workloads import cross_entropy, layernorm
from strategies import force_stitching

TARGET = "h100"

needs_devices = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest sets 4 host devices)")


def analyze(fun, *shapes):
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    traced = trace_mod.trace(fun, args, trace_mod.positional_tree(args))
    return traced, factors_mod.analyze(traced.graph)


# ---------------------------------------------------------------------------------------------------
# factors and placement (pure)
# ---------------------------------------------------------------------------------------------------

def test_layernorm_rows_and_hidden_are_factors():
    traced, f = analyze(layernorm, ((8, 16, 256), jnp.float32), ((256,), jnp.float32), ((256,), jnp.float32))
    x, gamma, beta = traced.graph.inputs
    (b,), (s,), (h,) = f.of(x)
    assert f.of(gamma) == ((h,),) and f.of(beta) == ((h,),)
    assert f.of(traced.graph.outputs[0]) == ((b,), (s,), (h,))
    assert len({b, s, h}) == 3 and not f.pinned


def test_merging_reshape_gives_a_compound_dimension():
    traced, f = analyze(lambda x: jax.nn.softmax(x.reshape(32, 64), axis=-1), ((4, 8, 64), jnp.float32))
    (b,), (s,), (h,) = f.of(traced.graph.inputs[0])
    assert f.of(traced.graph.outputs[0]) == ((b, s), (h,))


def test_slice_and_scan_pin_their_axis():
    traced, f = analyze(lambda x: jnp.cumsum(x[:, :100], axis=-1), ((8, 128), jnp.float32))
    (rows,), (cols,) = f.of(traced.graph.inputs[0])
    assert cols in f.pinned and rows not in f.pinned


def test_placement_follows_the_batch_through_a_reduction():
    traced, f = analyze(lambda x, g: (x * g, (x * g).sum(0)), ((8, 256), jnp.float32), ((256,), jnp.float32))
    p = placement_mod.place(f, traced.graph.inputs, [(("data",), ()), ((),)], traced.graph.outputs, {"data": 4})
    assert p.outputs == ((("data",), ()), ((),)) and not p.dropped


def test_placement_drops_what_it_cannot_split():
    traced, f = analyze(lambda x: jnp.cumsum(x, axis=-1) + 1, ((6, 128), jnp.float32))
    specs = [(("data",), ("model",))]
    p = placement_mod.place(f, traced.graph.inputs, specs, traced.graph.outputs, {"data": 4, "model": 2})
    assert not p.sharded and len(p.dropped) == 2  # 6 rows over 4 devices; the scanned axis is pinned
    assert "do not divide" in p.dropped[0] and "whole" in p.dropped[1]
    p = placement_mod.place(f, traced.graph.inputs, specs, traced.graph.outputs, {"data": 2, "model": 2})
    assert p.inputs == ((("data",), ()),) and "whole" in p.dropped[0]


def test_placement_takes_the_outputs_sharding_where_no_input_has_one():
    """A dropout mask drawn from a replicated key: no input is split, but its readers want it per
    batch shard (the partitioner's result sharding); the counters' iotas then count from the
    shard's offset (integration/spmd/localize.py)."""
    traced, f = analyze(lambda k: jax.random.bernoulli(jax.random.wrap_key_data(k), 0.9, (8, 256)),
                        ((2,), jnp.uint32))
    region_inputs = [v for v in traced.graph.inputs]
    p = placement_mod.place(f, region_inputs, [((),)], traced.graph.outputs, {"data": 4})
    assert not p.sharded
    p = placement_mod.place(f, region_inputs, [((),)], traced.graph.outputs, {"data": 4},
                            out_specs=[(("data",), ())])
    assert p.sharded and p.outputs == ((("data",), ()),) and not p.dropped


def test_minor_factor_of_a_merged_dimension_stays_whole():
    traced, f = analyze(lambda x: x.reshape(32, 64) * 2, ((4, 8, 64), jnp.float32))
    p = placement_mod.place(f, traced.graph.inputs, [((), ("data",), ())], traced.graph.outputs, {"data": 4})
    assert not p.sharded and "contiguous" in p.dropped[0]


# ---------------------------------------------------------------------------------------------------
# end to end on a mesh of host devices
# ---------------------------------------------------------------------------------------------------

def collectives(jitted, *args) -> dict:
    return count_collectives(jitted.lower(*args).compile().as_text())


@pytest.fixture
def placements(monkeypatch):
    """The placements the partition callback chose, in order."""
    seen = []
    place = spmd_lowering.place

    def spy(*args, **kwargs):
        seen.append(place(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(spmd_lowering, "place", spy)
    return seen


def mesh_of(shape, names):
    return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


def check(fun, args, placements, rtol=1e-5, atol=1e-5):
    """Stitched (whatever the cost model says of these small shapes) vs jax.jit, on sharded args."""
    ours, ref = jaxstitch.jit(fun, target=TARGET), jax.jit(fun)
    with force_stitching():
        got, want = ours(*args), ref(*args)
        c_ours = collectives(ours, *args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (g.sharding, w.sharding)
    assert placements and any(p.sharded for p in placements), "no region was partitioned"
    c_ref = collectives(ref, *args)
    assert c_ours["all-gather"] <= c_ref["all-gather"], (c_ours, c_ref)
    assert sum(c_ours.values()) <= sum(c_ref.values()), (c_ours, c_ref)
    return c_ours, c_ref


def normal(key, shape):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32)


@needs_devices
def test_data_parallel_layernorm_backward(placements):
    mesh = mesh_of((4,), ("data",))
    x = jax.device_put(normal(0, (8, 16, 256)), NamedSharding(mesh, P("data")))
    g, b = (jax.device_put(normal(k, (256,)), NamedSharding(mesh, P())) for k in (1, 2))
    grad = jax.value_and_grad(lambda x, g, b: jnp.sum(layernorm(x, g, b) ** 2), argnums=(0, 1, 2))
    c_ours, _ = check(grad, (x, g, b), placements, rtol=1e-4, atol=1e-3)
    assert c_ours["all-reduce"] >= 1  # dgamma, dbeta and the loss are completed across the batch


@needs_devices
def test_vocab_parallel_cross_entropy(placements):
    """Logits split over the vocabulary: the max and the sum go through pmax and psum, and the
    one-hot's iota counts from each shard's offset."""
    mesh = mesh_of((4,), ("model",))
    logits = jax.device_put(normal(3, (16, 512)), NamedSharding(mesh, P(None, "model")))
    labels = jax.device_put(jax.random.randint(jax.random.key(4), (16,), 0, 512), NamedSharding(mesh, P()))
    check(jax.value_and_grad(cross_entropy), (logits, labels), placements)


@needs_devices
def test_two_axis_mesh_softmax_over_merged_rows(placements):
    mesh = mesh_of((2, 2), ("data", "model"))
    x = jax.device_put(normal(5, (4, 8, 64)), NamedSharding(mesh, P("data", None, "model")))
    check(lambda x: jax.nn.softmax(x.reshape(32, 64) * 3.0, axis=-1).sum(0), (x,), placements)


@needs_devices
def test_a_split_the_region_cannot_take_is_gathered_and_logged(placements, caplog):
    """Rows split over the mesh, scanned along the rows: the region needs them whole."""
    mesh = mesh_of((4,), ("data",))
    x = jax.device_put(normal(6, (8, 128)), NamedSharding(mesh, P("data")))
    fun = lambda x: jnp.cumsum(jax.nn.gelu(x).T, axis=-1) * 2  # noqa: E731
    with force_stitching(), caplog.at_level("INFO", logger="jaxstitch"):
        np.testing.assert_allclose(jaxstitch.jit(fun, target=TARGET)(x), jax.jit(fun)(x), rtol=1e-5, atol=1e-5)
    assert any(p.dropped and not p.sharded for p in placements)
    assert any("needs it whole" in r.getMessage() for r in caplog.records)


@needs_devices
def test_in_and_out_shardings():
    mesh = mesh_of((4,), ("data",))
    rows, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    fun = jaxstitch.jit(lambda x: jax.nn.softmax(x, axis=-1), in_shardings=rows, out_shardings=rep, target=TARGET)
    x = normal(7, (32, 128))
    out = fun(x)
    assert out.sharding.is_equivalent_to(rep, 2)
    np.testing.assert_allclose(out, jax.nn.softmax(x, axis=-1), rtol=1e-5, atol=1e-6)


@needs_devices
def test_inside_shard_map_regions_are_planned_for_the_local_shape(placements):
    mesh = mesh_of((4,), ("data",))
    seen_shapes = []

    def body(x):
        seen_shapes.append(x.shape)
        return jaxstitch.jit(lambda x: layernorm(x, jnp.ones(x.shape[-1]), jnp.zeros(x.shape[-1])), target=TARGET)(x)

    fun = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    x = normal(8, (16, 256))
    np.testing.assert_allclose(fun(x), layernorm(x, jnp.ones(256), jnp.zeros(256)), rtol=1e-5, atol=1e-5)
    assert seen_shapes[0] == (4, 256) and not placements  # manual: no partition callback


@needs_devices
def test_grad_of_a_stitched_function_under_sharding(placements):
    mesh = mesh_of((4,), ("data",))
    x = jax.device_put(normal(9, (16, 256)), NamedSharding(mesh, P("data")))
    inner = jaxstitch.jit(lambda x: jax.nn.softmax(x, axis=-1), target=TARGET)
    ours = jax.jit(jax.grad(lambda x: jnp.sum(inner(x) ** 2)))
    want = jax.jit(jax.grad(lambda x: jnp.sum(jax.nn.softmax(x, axis=-1) ** 2)))(x)
    with force_stitching():
        np.testing.assert_allclose(ours(x), want, rtol=1e-4, atol=1e-6)
    assert any(p.sharded for p in placements)


@needs_devices
def test_data_parallel_bert_example(placements):
    """examples/dp_train.py on 1 and 2 host devices, every region stitched: the same losses as the
    1-device jax.jit run, no more collectives than jax.jit's, and most regions split over the batch."""
    pytest.importorskip("optax")
    import functools
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import bert_train
    import dp_train

    with force_stitching():
        ok, rows = dp_train.compare_devices(bert_train, bert_train.QUICK, steps=3, counts=(1, 2), rtol=1e-4,
                                            stitch_jit=functools.partial(jaxstitch.jit, target=TARGET))
    assert ok, [(n, {k: v for k, v in ref.collectives.items() if v}, {k: v for k, v in ours.collectives.items() if v},
                 diff, ref.losses[-1], ours.losses[-1]) for n, ref, ours, diff, _ in rows]
    sharded = sum(p.sharded for p in placements)
    assert sharded >= 35, (sharded, len(placements))  # (38 of 113 now: a third, as before cse.py merged equal equations)


def mlp_step(params, x, y):
    """One SGD step of a GELU MLP with a layer norm on its output (Megatron's MLP pattern when w1 is
    split by columns and w2 by rows): the GELU region runs on the split hidden units."""
    def loss(p):
        h = jax.nn.gelu(x @ p["w1"] + p["b1"])
        out = layernorm(h @ p["w2"] + p["b2"], p["gamma"], p["beta"])
        return jnp.mean((out - y) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def mlp_inputs(mesh, hidden=128, ffn=512, batch=32):
    keys = iter(jax.random.split(jax.random.key(11), 8))
    shapes = {"w1": ((hidden, ffn), P(None, "model")), "b1": ((ffn,), P("model")),
              "w2": ((ffn, hidden), P("model", None)), "b2": ((hidden,), P()),
              "gamma": ((hidden,), P()), "beta": ((hidden,), P())}
    params = {k: jax.device_put(normal(int(jax.random.randint(next(keys), (), 0, 1 << 30)), s) * 0.1,
                                NamedSharding(mesh, spec)) for k, (s, spec) in shapes.items()}
    x, y = (jax.device_put(normal(k, (batch, hidden)), NamedSharding(mesh, P("data"))) for k in (12, 13))
    return params, x, y


@needs_devices
def test_tensor_and_data_parallel_mlp_step(placements):
    mesh = mesh_of((2, 2), ("data", "model"))
    check(mlp_step, mlp_inputs(mesh), placements, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# per shard, what one device stitches
# ---------------------------------------------------------------------------------------------------

def _stitched(program) -> int:
    return sum(1 for _, c in program.all_regions() if c.stitched)


def _plan(example, config, batch):
    from jaxstitch import api
    from jaxstitch.core import config as config_mod
    from jaxstitch.integration import families

    graphdef, state = example.make_init(config, 0)()
    dyn, static, tree = api._split_dynamic((graphdef, state, batch), {})
    return families.build_any(example.train_step, dyn, tree, jaxstitch.get_target(TARGET), config_mod.load(), static)


@needs_devices
@pytest.mark.parametrize("model", ["bert", "gpt"])
def test_a_data_parallel_step_stitches_per_shard_what_one_device_stitches(model, monkeypatch, placements):
    """A train step split over 2 host devices on its batch: the program is planned as on one device
    (its stitched regions are those of the unsharded step at the global shapes), every region placed
    on the batch is planned again for its shard (no fallback to XLA), and the shards' kernels are as
    many as the unsharded step's at the per-device shapes (a shard's plan keeps the program's
    decision: spmd.lowering.for_shards; under a 2-GPU mesh only 26 of 176 memory-bound kernels had
    been stitched away)."""
    import dataclasses
    import importlib
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import dp_train
    from jaxstitch.integration import families

    example = importlib.import_module(f"{model}_train")
    sizes = {"bert": dict(layers=1, batch=16, seq=128), "gpt": dict(layers=1, batch=4, seq=256)}[model]
    config = dataclasses.replace(example.QUICK, **{**dataclasses.asdict(example.QUICK), **dict(
        hidden=256, heads=4, mlp=1024, **sizes)})
    batch = example.make_batches(config, 0)(0)
    half = dataclasses.replace(config, batch=config.batch // 2)
    whole, per_device = _plan(example, config, batch), _plan(example, half, example.make_batches(half, 0)(0))

    built = []
    build_any = families.build_any
    monkeypatch.setattr(families, "build_any", lambda *a, **k: built.append(build_any(*a, **k)) or built[-1])
    graphdef, state = example.make_init(config, 0)()
    place = dp_train.placer(jax.devices()[:2])
    step = jaxstitch.jit(example.train_step, target=TARGET, static_argnums=(0,))
    step.lower(graphdef, place(state, "state"), place(batch, "batch")).compile()
    top, shards = built[0], built[1:]
    sharded = [p for p in placements if p.sharded]
    assert _stitched(top) >= 0.9 * _stitched(whole), (_stitched(top), _stitched(whole))
    assert sharded and len(shards) == len(sharded)  # (each placed region planned for its shard)
    assert sum(_stitched(p) for p in shards) >= _stitched(per_device), (
        [_stitched(p) for p in shards], _stitched(per_device),
        [c.reason for p in shards for _, c in p.all_regions() if not c.stitched])


@needs_devices
def test_a_zoo_step_under_shard_map_stitches_what_one_device_stitches(monkeypatch, placements):
    """The zoo's Llama step inside `shard_map` over 2 devices (each device its own batch shard):
    planned at the local shapes as on one device, the same stitched regions (the gradients' mean
    over devices left out: the plan is what is compared, not training)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import zoo
    from jaxstitch.integration import families

    m = zoo.MODELS["llama"]
    config = m.quick(hidden=256, heads=4, kv_heads=2, mlp=512, seq=256, batch=8)
    graphdef, state = m.make_init(config, 0)()
    batch = m.make_batches(config, 0)(0)
    local = m.make_batches(dataclasses.replace(config, batch=config.batch // 2), 0)(0)
    one_device = _plan(m.module, dataclasses.replace(config, batch=config.batch // 2), local)

    built = []
    build_any = families.build_any
    monkeypatch.setattr(families, "build_any", lambda *a, **k: built.append(build_any(*a, **k)) or built[-1])
    mesh = mesh_of((2,), ("data",))
    body = jaxstitch.jit(lambda state, batch: m.step(graphdef, state, batch), target=TARGET)
    fun = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()),
                                check_vma=False))
    fun.lower(state, batch).compile()
    (program,) = built
    assert not placements  # (manual axes: no partition callback)
    assert _stitched(program) == _stitched(one_device) > 0


@needs_devices
def test_a_split_reductions_epilogue_is_no_piece_of_its_own(monkeypatch, placements):
    """A bias gradient (a column sum over batch-split rows) and Adam's `0.1 g`, `0.001 g^2` on it,
    read by the optimizer's update: the tail belongs to the update's region (graph/tails.py), so
    each shard's program is its reduction alone, ending with the all-reduce. With the tail in the
    reduction's region, the ops after the all-reduce were a kernel of their own, which XLA cannot
    fuse into our update kernel (2 H200s, a data-parallel BERT step: 126 such kernels)."""
    from jaxstitch.integration import families

    def step(x, m, v):
        g = jnp.sum(x * 2.0, axis=0)
        return 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g

    mesh = mesh_of((4,), ("data",))
    x = jax.device_put(normal(7, (64, 256)), NamedSharding(mesh, P("data")))
    m, v = (jax.device_put(normal(k, (256,)), NamedSharding(mesh, P())) for k in (8, 9))
    built = []
    build_any = families.build_any
    monkeypatch.setattr(families, "build_any", lambda *a, **k: built.append(build_any(*a, **k)) or built[-1])
    with force_stitching():
        got, want = jaxstitch.jit(step, target=TARGET)(x, m, v), jax.jit(step)(x, m, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    shards = built[1:]
    assert shards and any(p.sharded for p in placements)
    assert all(len(list(p.all_regions())) == 1 for p in shards), [
        [sorted({op.prim for op in c.plan.region.ops}) for _, c in p.all_regions()] for p in shards]
