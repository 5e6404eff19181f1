"""A DLRM-like click-through model (Naumov et al. 2019) on Criteo-shaped synthetic data.

13 dense features through a bottom MLP (512, 256, 128); 26 categorical features, each a bag of up to 4
ids hashed into its own table of 32768 rows x 128, looked up with `jnp.take` and summed over the bag
(an embedding bag: bags shorter than 4 are masked); DLRM's dot interaction (every pair among the 27
feature vectors, the strictly lower triangle of their Gram matrix, 351 values) concatenated with the
dense vector into a top MLP (1024, 1024, 512, 256, 1) and a logistic loss. Adagrad, whose update
reads and writes the whole 436 MB of tables every step, as does their gradient's scatter-add.
Batch 8192.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from . import common


@dataclasses.dataclass(frozen=True)
class Config:
    batch: int = 8192
    dense: int = 13
    tables: int = 26
    rows: int = 32768
    bag: int = 4
    embed: int = 128
    bottom: tuple = (512, 256)   # then `embed`
    top: tuple = (1024, 1024, 512, 256)  # then 1
    dtype: str = "float32"


QUICK = Config(batch=8, tables=3, rows=32, bag=2, embed=8, bottom=(16,), top=(16,))


def mlp(sizes, dtype, rngs):
    return nnx.List([nnx.Linear(a, b, dtype=dtype, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])])


def run_mlp(layers, x):
    for layer in layers[:-1]:
        x = jax.nn.relu(layer(x))
    return layers[-1](x)


class DLRM(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.c = c
        bound = 1.0 / np.sqrt(c.rows)  # (DLRM's uniform init of its tables)
        self.tables = nnx.Param(jax.random.uniform(rngs.params(), (c.tables * c.rows, c.embed),
                                                   jnp.float32, -bound, bound))
        self.bottom = mlp((c.dense, *c.bottom, c.embed), c.dtype, rngs)
        pairs = (c.tables + 1) * c.tables // 2
        self.top = mlp((c.embed + pairs, *c.top, 1), c.dtype, rngs)

    def embedding_bags(self, ids, lengths):
        """ids [batch, tables, bag] (each table's own rows), lengths [batch, tables] -> the sum of each
        bag's rows [batch, tables, embed]."""
        c = self.c
        rows = ids + (jnp.arange(c.tables) * c.rows)[None, :, None]  # into the stacked tables
        vectors = jnp.take(self.tables[...], rows, axis=0).astype(c.dtype)
        valid = jnp.arange(c.bag)[None, None, :] < lengths[..., None]
        return jnp.sum(vectors * valid[..., None].astype(c.dtype), axis=2)

    def __call__(self, batch):
        dense = run_mlp(self.bottom, batch["dense"].astype(self.c.dtype))
        features = jnp.concatenate([dense[:, None], self.embedding_bags(batch["ids"], batch["lengths"])], 1)
        gram = jnp.einsum("bid,bjd->bij", features, features)
        lower_i, lower_j = np.tril_indices(features.shape[1], k=-1)
        pairs = gram[:, lower_i, lower_j]
        return run_mlp(self.top, jnp.concatenate([dense, pairs], axis=-1))[:, 0].astype(jnp.float32)


def make_init(c: Config, seed: int):
    return common.train_init(lambda: DLRM(c, nnx.Rngs(params=seed)), optax.adagrad(0.01))


def make_batches(c: Config, seed: int):
    """Positive dense features (softplus of normals), skewed ids (a few rows take most lookups), and
    clicks that depend on the first dense feature, so the loss can fall."""
    def batch(i):
        k = jax.random.split(jax.random.fold_in(jax.random.key(seed), i), 5)
        dense = jnp.log1p(jnp.exp(jax.random.normal(k[0], (c.batch, c.dense))))
        u = jax.random.uniform(k[1], (c.batch, c.tables, c.bag))
        ids = jnp.minimum((c.rows * u ** 3).astype(jnp.int32), c.rows - 1)
        lengths = jax.random.randint(k[2], (c.batch, c.tables), 1, c.bag + 1)
        p = jax.nn.sigmoid(2.0 * (dense[:, 0] - 0.8) + 0.3 * jax.random.normal(k[3], (c.batch,)))
        return {"dense": dense, "ids": ids, "lengths": lengths,
                "clicked": jax.random.bernoulli(k[4], p).astype(jnp.float32)}
    return batch


def loss(model, batch):
    return optax.sigmoid_binary_cross_entropy(model(batch), batch["clicked"]).mean()


train_step = common.train_step(loss)
