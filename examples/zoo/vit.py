"""A Vision Transformer (Dosovitskiy et al. 2021) at ViT-S/16's size: 224x224 images in 16x16
patches (196 tokens and a class token), 12 pre-LayerNorm encoder blocks of width 384 with 6 heads
and an exact-GELU MLP of 1536, dropout 0.1 after the patch embedding, the attention's projection and
the MLP. AdamW after clipping the gradients' global norm to 1, as ViT is trained.

Memory-bound: the LayerNorms, the softmax over 197 x 197 logits per head, the GELU, the dropouts and
residual adds, the head split and merge around the attention products, and the optimizer's update
with its global-norm reduction over every parameter.
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
    dim: int = 384
    depth: int = 12
    heads: int = 6
    mlp: int = 1536
    classes: int = 1000
    dropout: float = 0.1
    dtype: str = "float32"


QUICK = Config(batch=2, image=32, patch=8, dim=32, depth=2, heads=2, mlp=64, classes=10)


class Block(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.heads = c.heads
        self.norm1 = nnx.LayerNorm(c.dim, epsilon=1e-6, dtype=c.dtype, rngs=rngs)
        self.qkv = nnx.Linear(c.dim, 3 * c.dim, dtype=c.dtype, rngs=rngs)
        self.out = nnx.Linear(c.dim, c.dim, dtype=c.dtype, rngs=rngs)
        self.norm2 = nnx.LayerNorm(c.dim, epsilon=1e-6, dtype=c.dtype, rngs=rngs)
        self.up = nnx.Linear(c.dim, c.mlp, dtype=c.dtype, rngs=rngs)
        self.down = nnx.Linear(c.mlp, c.dim, dtype=c.dtype, rngs=rngs)
        self.drop = nnx.Dropout(c.dropout, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)).reshape(b, t, 3, self.heads, d // self.heads), 3, axis=2)
        y = common.attention(q[:, :, 0], k[:, :, 0], v[:, :, 0]).reshape(b, t, d)
        x = x + self.drop(self.out(y))
        y = self.down(jax.nn.gelu(self.up(self.norm2(x)), approximate=False))
        return x + self.drop(y)


class ViT(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        tokens = (c.image // c.patch) ** 2 + 1
        self.embed = nnx.Conv(3, c.dim, (c.patch, c.patch), strides=c.patch, padding="VALID", dtype=c.dtype,
                              rngs=rngs)
        self.cls = nnx.Param(jnp.zeros((1, 1, c.dim), jnp.float32))
        self.positions = nnx.Param(0.02 * jax.random.normal(rngs.params(), (1, tokens, c.dim), jnp.float32))
        self.drop = nnx.Dropout(c.dropout, rngs=rngs)
        self.blocks = nnx.List([Block(c, rngs) for _ in range(c.depth)])
        self.norm = nnx.LayerNorm(c.dim, epsilon=1e-6, dtype=c.dtype, rngs=rngs)
        self.head = nnx.Linear(c.dim, c.classes, dtype=c.dtype, rngs=rngs)

    def __call__(self, images):
        x = self.embed(images)
        b, h, w, d = x.shape
        cls = jnp.broadcast_to(self.cls[...], (b, 1, d)).astype(x.dtype)
        x = jnp.concatenate([cls, x.reshape(b, h * w, d)], axis=1) + self.positions[...].astype(x.dtype)
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0])).astype(jnp.float32)


def _optimizer() -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.05))


def make_init(c: Config, seed: int):
    return common.train_init(lambda: ViT(c, nnx.Rngs(params=seed, dropout=seed + 1)), _optimizer())



make_batches = common.image_batches
evaluate = common.classify_images


def loss(model, batch):
    return evaluate(model, batch)[0]


train_step = common.train_step(loss)
