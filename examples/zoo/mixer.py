"""MLP-Mixer (Tolstikhin et al. 2021) at Mixer-S/16's size: 224x224 images in 16x16 patches (196
tokens), 8 blocks of width 512, each a token-mixing MLP (196 -> 256 -> 196) applied across the
tokens with the channels and tokens axes swapped, then a channel-mixing MLP (512 -> 2048 -> 512),
both after a LayerNorm and with a residual add; exact GELU; global average pooling and a linear
head. AdamW.

Memory-bound: the LayerNorms, the GELUs and residual adds, and the swaps of the token and channel
axes around every token-mixing MLP (transposes between products).
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
    batch: int = 64
    image: int = 224
    patch: int = 16
    dim: int = 512
    depth: int = 8
    token_mlp: int = 256
    channel_mlp: int = 2048
    classes: int = 1000
    dtype: str = "float32"


QUICK = Config(batch=2, image=32, patch=8, dim=32, depth=2, token_mlp=16, channel_mlp=64, classes=10)


class Mlp(nnx.Module):
    def __init__(self, width: int, hidden: int, c: Config, rngs: nnx.Rngs):
        self.up = nnx.Linear(width, hidden, dtype=c.dtype, rngs=rngs)
        self.down = nnx.Linear(hidden, width, dtype=c.dtype, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x), approximate=False))


class Block(nnx.Module):
    def __init__(self, tokens: int, c: Config, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(c.dim, epsilon=1e-6, dtype=c.dtype, rngs=rngs)
        self.tokens = Mlp(tokens, c.token_mlp, c, rngs)
        self.norm2 = nnx.LayerNorm(c.dim, epsilon=1e-6, dtype=c.dtype, rngs=rngs)
        self.channels = Mlp(c.dim, c.channel_mlp, c, rngs)

    def __call__(self, x):
        x = x + jnp.swapaxes(self.tokens(jnp.swapaxes(self.norm1(x), 1, 2)), 1, 2)
        return x + self.channels(self.norm2(x))


class Mixer(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        tokens = (c.image // c.patch) ** 2
        self.embed = nnx.Conv(3, c.dim, (c.patch, c.patch), strides=c.patch, padding="VALID", dtype=c.dtype,
                              rngs=rngs)
        self.blocks = nnx.List([Block(tokens, c, rngs) for _ in range(c.depth)])
        self.norm = nnx.LayerNorm(c.dim, epsilon=1e-6, dtype=c.dtype, rngs=rngs)
        self.head = nnx.Linear(c.dim, c.classes, dtype=c.dtype, rngs=rngs)

    def __call__(self, images):
        x = self.embed(images)
        b, h, w, d = x.shape
        x = x.reshape(b, h * w, d)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(axis=1)).astype(jnp.float32)


def make_init(c: Config, seed: int):
    return common.train_init(lambda: Mixer(c, nnx.Rngs(params=seed)), optax.adamw(1e-3, weight_decay=0.05))



make_batches = common.image_batches
evaluate = common.classify_images


def loss(model, batch):
    return evaluate(model, batch)[0]


train_step = common.train_step(loss)
