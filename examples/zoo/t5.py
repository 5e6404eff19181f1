"""A T5-style encoder (Raffel et al. 2020, the v1.1 layout) trained to restore corrupted tokens.

Pre-norm blocks of an RMS LayerNorm without mean or bias, self-attention whose logits get a learned
bias per head and relative-position bucket (bidirectional, log-spaced beyond 16 positions, shared by
all layers; no 1/sqrt(d) scaling, as in T5), and a gated-GELU feed-forward layer. Sequences are
padded to 512 tokens (keys past a sequence's length are masked); 15% of the tokens are replaced by a
sentinel and predicted through an untied output layer. Adafactor, T5's optimizer, whose factored
second moments are row and column means of every squared gradient.

6 layers, hidden 768, 12 heads of 64, feed-forward 2048, vocabulary 32128, batch 16 x 512.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from . import common


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int = 6
    hidden: int = 768
    heads: int = 12
    ff: int = 2048
    vocab: int = 32128
    seq: int = 512
    batch: int = 16
    buckets: int = 32
    max_distance: int = 128
    corrupt: float = 0.15
    dtype: str = "float32"


QUICK = Config(layers=1, hidden=32, heads=2, ff=64, vocab=128, seq=16, batch=2, buckets=8, max_distance=16,
               corrupt=0.3)


def relative_bucket(relative, buckets: int, max_distance: int):
    """T5's bucket of a key's offset from its query: half the buckets per direction; offsets below a
    quarter of the buckets each get their own, larger ones share log-spaced buckets up to
    `max_distance`."""
    half = buckets // 2
    exact = half // 2
    side = jnp.where(relative > 0, half, 0)
    distance = jnp.abs(relative)
    far = exact + (jnp.log(jnp.maximum(distance, 1) / exact) / math.log(max_distance / exact)
                   * (half - exact)).astype(jnp.int32)
    return side + jnp.where(distance < exact, distance, jnp.minimum(far, half - 1))


class RMSNorm(nnx.Module):
    """T5's LayerNorm: scale by the root mean square (in float32), no centring, no bias."""

    def __init__(self, dim: int, dtype: str):
        self.weight, self.dtype = nnx.Param(jnp.ones((dim,), jnp.float32)), dtype

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + 1e-6)
        return (x32 * self.weight[...]).astype(self.dtype)


class Layer(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=c.dtype, rngs=rngs)  # noqa: E731
        self.heads = c.heads
        self.attn_norm, self.ff_norm = RMSNorm(c.hidden, c.dtype), RMSNorm(c.hidden, c.dtype)
        self.qkv, self.out = linear(c.hidden, 3 * c.hidden), linear(c.hidden, c.hidden)
        self.gate, self.up, self.down = linear(c.hidden, c.ff), linear(c.hidden, c.ff), linear(c.ff, c.hidden)

    def __call__(self, x, bias):
        b, s, d = x.shape
        q, k, v = jnp.split(self.qkv(self.attn_norm(x)).reshape(b, s, 3 * self.heads, d // self.heads), 3, axis=2)
        x = x + self.out(common.attention(q, k, v, bias, scale=1.0).reshape(b, s, d))
        h = self.ff_norm(x)
        return x + self.down(jax.nn.gelu(self.gate(h), approximate=True) * self.up(h))


class Encoder(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.c = c
        self.embed = nnx.Embed(c.vocab, c.hidden, dtype=c.dtype, rngs=rngs)
        self.position_bias = nnx.Embed(c.buckets, c.heads, rngs=rngs)  # float32, added to the logits
        self.layers = nnx.List([Layer(c, rngs) for _ in range(c.layers)])
        self.norm = RMSNorm(c.hidden, c.dtype)
        self.output = nnx.Linear(c.hidden, c.vocab, use_bias=False, dtype=c.dtype, rngs=rngs)

    def __call__(self, tokens, lengths):
        s = tokens.shape[1]
        offsets = jnp.arange(s)[None, :] - jnp.arange(s)[:, None]  # key minus query
        bias = self.position_bias(relative_bucket(offsets, self.c.buckets, self.c.max_distance))
        padded = jnp.arange(s)[None, :] >= lengths[:, None]  # [batch, key]
        bias = jnp.transpose(bias, (2, 0, 1))[None] + jnp.where(padded, -1e9, 0.0)[:, None, None, :]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, bias)
        return self.output(self.norm(x)).astype(jnp.float32)


def make_init(c: Config, seed: int):
    return common.train_init(lambda: Encoder(c, nnx.Rngs(params=seed)), optax.adafactor(1e-3))


def make_batches(c: Config, seed: int):
    def batch(i):
        k1, k2, k3 = jax.random.split(jax.random.fold_in(jax.random.key(seed), i), 3)
        targets = jax.random.randint(k1, (c.batch, c.seq), 0, c.vocab - 1)
        lengths = jax.random.randint(k2, (c.batch,), c.seq // 2, c.seq + 1)
        valid = jnp.arange(c.seq)[None, :] < lengths[:, None]
        corrupt = jax.random.bernoulli(k3, c.corrupt, (c.batch, c.seq)) & valid
        return {"tokens": jnp.where(corrupt, c.vocab - 1, targets), "targets": targets,
                "lengths": lengths, "weights": corrupt.astype(jnp.float32)}
    return batch


def loss(model, batch):
    logits = model(batch["tokens"], batch["lengths"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return (losses * batch["weights"]).sum() / jnp.maximum(batch["weights"].sum(), 1.0)


train_step = common.train_step(loss)
