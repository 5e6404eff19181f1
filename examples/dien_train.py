"""A DIEN-like click-through model (Flax NNX + optax Adam) trained under jax.jit and jaxstitch.jit.

Deep Interest Evolution Network (Zhou et al., AAAI'19), the model AStitch found hardest: embedding
lookups for the user, the target item and a 50-long behaviour sequence (item + category, 18 + 18 = 36
features); an interest-extractor GRU over the sequence in `lax.scan` with DIEN's auxiliary next-click
loss; DIN-style attention of the target over the GRU states through a small MLP (80, 40); an
attention-gated GRU (AUGRU) in a second scan; and a final MLP (200, 80) with a logistic loss. Every
tensor is narrow (36 features, 50 steps), so the step is many small memory-bound kernels. Data is
synthetic, from the seed; the sequences have random lengths and are masked.

    python examples/dien_train.py            # batch 256
    python examples/dien_train.py --quick    # a tiny model (runs anywhere)
"""
from __future__ import annotations

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_harness  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
    users: int = 50000
    items: int = 100000
    categories: int = 1000
    embed: int = 18  # per id; an item is item + category = 36 features
    seq: int = 50
    batch: int = 256
    attention: tuple = (80, 40)
    mlp: tuple = (200, 80)
    auxiliary: tuple = (100, 50)


QUICK = Config(users=100, items=500, categories=20, seq=10, batch=16)


def mlp_layers(sizes, rngs):
    return nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])])


def run_mlp(layers, x, activation):
    for layer in layers[:-1]:
        x = activation(layer(x))
    return layers[-1](x)


class GRU(nnx.Module):
    """A GRU whose input projection is one matrix product over the whole sequence; the scan body
    holds the recurrent product and the gate arithmetic. With `attention`, DIEN's AUGRU: the update
    gate is scaled by each step's attention score."""

    def __init__(self, features: int, hidden: int, rngs: nnx.Rngs):
        self.inputs = nnx.Linear(features, 3 * hidden, rngs=rngs)
        self.recurrent = nnx.Linear(hidden, 3 * hidden, use_bias=False, rngs=rngs)
        self.hidden = hidden

    def __call__(self, xs, mask, attention=None):
        """xs [batch, seq, features], mask [batch, seq] -> states [batch, seq, hidden]."""
        gx = jnp.swapaxes(self.inputs(xs), 0, 1)  # [seq, batch, 3 hidden]
        steps = jnp.swapaxes(mask, 0, 1)[..., None]
        scores = (jnp.ones(steps.shape, xs.dtype) if attention is None
                  else jnp.swapaxes(attention, 0, 1)[..., None])
        kernel = self.recurrent.kernel[...]

        def step(h, inputs):
            g, valid, a = inputs
            gr, gz, gn = jnp.split(g, 3, axis=-1)
            hr, hz, hn = jnp.split(h @ kernel, 3, axis=-1)
            r = jax.nn.sigmoid(gr + hr)
            z = a * jax.nn.sigmoid(gz + hz)  # the update gate (AUGRU: scaled by attention)
            n = jnp.tanh(gn + r * hn)
            h = jnp.where(valid, (1 - z) * h + z * n, h)
            return h, h

        h0 = jnp.zeros((xs.shape[0], self.hidden), xs.dtype)
        _, states = jax.lax.scan(step, h0, (gx, steps, scores))
        return jnp.swapaxes(states, 0, 1)


class DIEN(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        d = 2 * c.embed
        self.users = nnx.Embed(c.users, c.embed, rngs=rngs)
        self.items = nnx.Embed(c.items, c.embed, rngs=rngs)
        self.categories = nnx.Embed(c.categories, c.embed, rngs=rngs)
        self.extractor = GRU(d, d, rngs)
        self.auxiliary = mlp_layers((2 * d, *c.auxiliary, 1), rngs)
        self.attention = mlp_layers((4 * d, *c.attention, 1), rngs)
        self.evolution = GRU(d, d, rngs)
        self.head = mlp_layers((c.embed + 3 * d, *c.mlp, 1), rngs)

    def item(self, ids, cats):
        return jnp.concatenate([self.items(ids), self.categories(cats)], axis=-1)

    def __call__(self, batch):
        """(click logits [batch], auxiliary loss)."""
        mask = jnp.arange(batch["history"].shape[1])[None] < batch["length"][:, None]
        history = self.item(batch["history"], batch["history_cat"])  # [batch, seq, 36]
        negatives = self.item(batch["negative"], batch["negative_cat"])
        target = self.item(batch["target"], batch["target_cat"])  # [batch, 36]
        states = self.extractor(history, mask)

        # Auxiliary loss: each state predicts the next clicked item against a sampled negative.
        def next_click(follow):
            return run_mlp(self.auxiliary, jnp.concatenate([states[:, :-1], follow[:, 1:]], -1),
                           jax.nn.sigmoid)[..., 0]
        steps = mask[:, 1:].astype(jnp.float32)
        aux = (optax.sigmoid_binary_cross_entropy(next_click(history), 1.0)
               + optax.sigmoid_binary_cross_entropy(next_click(negatives), 0.0))
        aux = (aux * steps).sum() / steps.sum()

        # Attention of the target item over the interest states (DIN's activation unit).
        t = jnp.broadcast_to(target[:, None], states.shape)
        units = jnp.concatenate([states, t, states - t, states * t], axis=-1)
        logits = run_mlp(self.attention, units, jax.nn.sigmoid)[..., 0]
        weights = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)

        final = self.evolution(history, mask, attention=weights)
        last = jnp.take_along_axis(final, (batch["length"] - 1)[:, None, None], axis=1)[:, 0]
        pooled = (history * mask[..., None]).sum(1)
        features = jnp.concatenate([self.users(batch["user"]), target, last, pooled], axis=-1)
        return run_mlp(self.head, features, jax.nn.relu)[..., 0], aux


def make_init(c: Config, seed: int):
    def init():
        model = DIEN(c, nnx.Rngs(params=seed))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        return nnx.split((model, optimizer))
    return init


def make_batches(c: Config, seed: int):
    def batch(i):
        k = jax.random.split(jax.random.fold_in(jax.random.key(seed), i), 9)
        ids = lambda key, n, shape: jax.random.randint(key, shape, 0, n)  # noqa: E731
        return {"user": ids(k[0], c.users, (c.batch,)),
                "target": ids(k[1], c.items, (c.batch,)), "target_cat": ids(k[2], c.categories, (c.batch,)),
                "history": ids(k[3], c.items, (c.batch, c.seq)),
                "history_cat": ids(k[4], c.categories, (c.batch, c.seq)),
                "negative": ids(k[5], c.items, (c.batch, c.seq)),
                "negative_cat": ids(k[6], c.categories, (c.batch, c.seq)),
                "length": jax.random.randint(k[7], (c.batch,), 2, c.seq + 1),
                "clicked": jax.random.bernoulli(k[8], 0.5, (c.batch,)).astype(jnp.float32)}
    return batch


def loss(model, batch):
    logits, aux = model(batch)
    return optax.sigmoid_binary_cross_entropy(logits, batch["clicked"]).mean() + aux


train_step = train_harness.nnx_train_step(loss)


def main():
    args = train_harness.parser(__doc__.splitlines()[0]).parse_args()
    c = train_harness.configured(args, Config(), QUICK)
    train_harness.main("DIEN train step", sys.modules[__name__], args, c)


if __name__ == "__main__":
    main()
