"""A Conformer encoder (Gulati et al. 2020; Conformer-M's widths, half its depth) as a frame classifier.

Each block: a half-step feed-forward module (LayerNorm, 4x expansion, Swish), multi-head
self-attention (LayerNorm first; padded frames masked out as keys), the convolution module
(LayerNorm, pointwise convolution to 2x, GLU, a depthwise convolution of 31 taps over time,
BatchNorm in training mode, Swish, pointwise convolution), a second half-step feed-forward module and
a final LayerNorm. The 80 filterbank features of each frame (already subsampled; no convolutional
front end) are projected in and get sinusoidal positions; the loss is a cross-entropy per valid frame
against 256 classes. AdamW.

8 blocks, hidden 256, 4 heads, feed-forward 1024, batch 32 x 512 frames.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from . import common


@dataclasses.dataclass(frozen=True)
class Config:
    blocks: int = 8
    hidden: int = 256
    heads: int = 4
    ff: int = 1024
    taps: int = 31
    features: int = 80
    classes: int = 256
    seq: int = 512
    batch: int = 32
    dtype: str = "float32"


QUICK = Config(blocks=1, hidden=16, heads=2, ff=32, taps=5, features=8, classes=8, seq=8, batch=2)


class FeedForward(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(c.hidden, dtype=c.dtype, rngs=rngs)
        self.expand = nnx.Linear(c.hidden, c.ff, dtype=c.dtype, rngs=rngs)
        self.project = nnx.Linear(c.ff, c.hidden, dtype=c.dtype, rngs=rngs)

    def __call__(self, x):
        return self.project(jax.nn.swish(self.expand(self.norm(x))))


class ConvModule(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(c.hidden, dtype=c.dtype, rngs=rngs)
        self.pointwise1 = nnx.Linear(c.hidden, 2 * c.hidden, dtype=c.dtype, rngs=rngs)
        self.depthwise = nnx.Conv(c.hidden, c.hidden, (c.taps,), feature_group_count=c.hidden, dtype=c.dtype,
                                  rngs=rngs)
        self.batch_norm = nnx.BatchNorm(c.hidden, momentum=0.9, dtype=c.dtype, rngs=rngs)
        self.pointwise2 = nnx.Linear(c.hidden, c.hidden, dtype=c.dtype, rngs=rngs)

    def __call__(self, x):
        value, gate = jnp.split(self.pointwise1(self.norm(x)), 2, axis=-1)
        y = self.depthwise(value * jax.nn.sigmoid(gate))  # GLU, then 31 taps over time
        return self.pointwise2(jax.nn.swish(self.batch_norm(y)))


class Block(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.heads = c.heads
        self.ff1, self.ff2 = FeedForward(c, rngs), FeedForward(c, rngs)
        self.attn_norm = nnx.LayerNorm(c.hidden, dtype=c.dtype, rngs=rngs)
        self.qkv = nnx.Linear(c.hidden, 3 * c.hidden, dtype=c.dtype, rngs=rngs)
        self.attn_out = nnx.Linear(c.hidden, c.hidden, dtype=c.dtype, rngs=rngs)
        self.conv = ConvModule(c, rngs)
        self.norm = nnx.LayerNorm(c.hidden, dtype=c.dtype, rngs=rngs)

    def __call__(self, x, key_bias):
        b, s, d = x.shape
        x = x + 0.5 * self.ff1(x)
        q, k, v = jnp.split(self.qkv(self.attn_norm(x)).reshape(b, s, 3 * self.heads, d // self.heads), 3, axis=2)
        x = x + self.attn_out(common.attention(q, k, v, key_bias).reshape(b, s, d))
        x = x + self.conv(x)
        return self.norm(x + 0.5 * self.ff2(x))


def sinusoids(seq: int, dim: int):
    """Transformer positions [seq, dim]: sines and cosines of geometrically spaced frequencies."""
    freqs = 10000.0 ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class Conformer(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.hidden = c.hidden
        self.inputs = nnx.Linear(c.features, c.hidden, dtype=c.dtype, rngs=rngs)
        self.blocks = nnx.List([Block(c, rngs) for _ in range(c.blocks)])
        self.output = nnx.Linear(c.hidden, c.classes, dtype=c.dtype, rngs=rngs)

    def __call__(self, features, lengths):
        b, s, _ = features.shape
        x = self.inputs(features) + sinusoids(s, self.hidden).astype(features.dtype)
        padded = jnp.arange(s)[None, :] >= lengths[:, None]
        key_bias = jnp.where(padded, -1e9, 0.0)[:, None, None, :]  # [batch, 1, 1, key]
        for block in self.blocks:
            x = block(x, key_bias)
        return self.output(x).astype(jnp.float32)


def make_init(c: Config, seed: int):
    return common.train_init(lambda: Conformer(c, nnx.Rngs(params=seed)), optax.adamw(5e-4, weight_decay=0.01))


def make_batches(c: Config, seed: int):
    def batch(i):
        k1, k2, k3 = jax.random.split(jax.random.fold_in(jax.random.key(seed), i), 3)
        lengths = jax.random.randint(k2, (c.batch,), c.seq // 2, c.seq + 1)
        return {"features": jax.random.normal(k1, (c.batch, c.seq, c.features)).astype(c.dtype),
                "lengths": lengths, "labels": jax.random.randint(k3, (c.batch, c.seq), 0, c.classes)}
    return batch


def loss(model, batch):
    losses = optax.softmax_cross_entropy_with_integer_labels(model(batch["features"], batch["lengths"]),
                                                             batch["labels"])
    valid = (jnp.arange(losses.shape[1])[None, :] < batch["lengths"][:, None]).astype(jnp.float32)
    return (losses * valid).sum() / valid.sum()


train_step = common.train_step(loss)
