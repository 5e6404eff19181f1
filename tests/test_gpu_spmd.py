"""Stitched regions on two GPUs of one host: batch split (data parallel), vocabulary split (tensor
parallel), inside shard_map, and a whole data-parallel BERT train step. Each result against jax.jit
on the same sharded inputs with outputs poisoned (JAXSTITCH_POISON); each compiled program has our
kernels in it and no more collectives than jax.jit's."""
from __future__ import annotations

import contextlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxstitch
from jaxstitch.bench.runner import count_collectives
from jaxstitch.integration import ffi
from jaxstitch.bench.workloads import cross_entropy, layernorm, softmax_fwdbwd
from strategies import force_stitching
from test_gpu_correctness import compare

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    sum(d.platform == "gpu" for d in jax.devices()) < 2, reason="needs 2 GPUs")]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setenv("JAXSTITCH_POISON", "1")


def mesh2(name):
    return Mesh(np.array(jax.devices()[:2]), (name,))


def check(fun, args, what, forced=False):
    """`forced`: every region stitched, whatever the cost model says of the shards."""
    ours, ref = jaxstitch.jit(fun), jax.jit(fun)
    with force_stitching() if forced else contextlib.nullcontext():
        for i, (g, w) in enumerate(zip(jax.tree.leaves(ours(*args)), jax.tree.leaves(ref(*args)))):
            compare(g, w, f"{what} output {i}")
        text, ref_text = (f.lower(*args).compile().as_text() for f in (ours, ref))
    assert f'custom_call_target="{ffi.TARGET}"' in text, f"{what}: none of our kernels in the program"
    c_ours, c_ref = count_collectives(text), count_collectives(ref_text)
    assert all(c_ours[k] <= c_ref[k] for k in c_ref), (what, c_ours, c_ref)


def test_data_parallel_layernorm_backward():
    mesh = mesh2("data")
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.device_put(jax.random.normal(ks[0], (8, 1024, 1024)), NamedSharding(mesh, P("data")))
    g, b = (jax.device_put(jax.random.normal(k, (1024,)), NamedSharding(mesh, P())) for k in ks[1:])
    grad = jax.value_and_grad(lambda x, g, b: jnp.sum(layernorm(x, g, b) ** 2), argnums=(0, 1, 2))
    check(grad, (x, g, b), "layernorm fwd+bwd, batch over 2 GPUs")


def test_vocab_parallel_cross_entropy():
    """Forced: pmax and psum cut the region into one-pass pieces that the cost model leaves to XLA."""
    mesh = mesh2("model")
    logits = jax.device_put(jax.random.normal(jax.random.key(1), (2048, 32768)) * 3,
                            NamedSharding(mesh, P(None, "model")))
    labels = jax.device_put(jax.random.randint(jax.random.key(2), (2048,), 0, 32768), NamedSharding(mesh, P()))
    check(jax.value_and_grad(cross_entropy), (logits, labels), "cross-entropy fwd+bwd, vocabulary over 2 GPUs",
          forced=True)


def test_inside_shard_map():
    """A softmax forward and backward in a shard_map body: planned for the local rows."""
    mesh = mesh2("data")
    inner = jaxstitch.jit(softmax_fwdbwd)
    fun = jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=(P("data"), P("data")),
                                out_specs=(P("data"), P("data"))))
    x, dy = (jax.random.normal(jax.random.key(k), (8192, 1024)) for k in (3, 4))
    for i, (g, w) in enumerate(zip(fun(x, dy), jax.jit(softmax_fwdbwd)(x, dy))):
        compare(g, w, f"shard_map softmax fwd+bwd output {i}")
    assert f'custom_call_target="{ffi.TARGET}"' in fun.lower(x, dy).compile().as_text()


def test_data_parallel_bert_train_step():
    pytest.importorskip("optax")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import bert_train
    import dp_train

    ok, rows = dp_train.compare_devices(bert_train, bert_train.QUICK, steps=5, counts=(1, 2), rtol=2e-3)
    assert ok, [(n, {k: v for k, v in ref.collectives.items() if v}, {k: v for k, v in ours.collectives.items() if v},
                 diff, ref.losses[-1], ours.losses[-1]) for n, ref, ours, diff, _ in rows]


def test_tensor_parallel_mlp_step():
    """Megatron's MLP split over 2 GPUs (w1 by columns, w2 by rows), a layer norm after it, one SGD
    step; forced so the GELU region on the split hidden units runs as our kernel too."""
    from test_spmd import mlp_inputs, mlp_step

    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    check(mlp_step, mlp_inputs(mesh, hidden=1024, ffn=4096, batch=4096), "MLP step, hidden units over 2 GPUs",
          forced=True)
