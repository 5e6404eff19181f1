"""ConvNeXt (Liu et al. 2022): ConvNeXt-T's widths and two thirds of its depth, on 128x128 images.

A 4x4 patchify stem, four stages of (2, 2, 6, 2) blocks at widths (96, 192, 384, 768) with a
channels-last LayerNorm and a 2x2 strided convolution between stages. A block is a depthwise 7x7
convolution, a LayerNorm over channels, a pointwise MLP (4x, exact GELU) and a learned per-channel
layer scale on the residual branch. AdamW. The LayerNorms, GELUs, layer scales and residual adds sit
between every pair of products, and the depthwise convolution itself moves more bytes than it
computes.
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
    image: int = 128
    patch: int = 4
    dims: tuple = (96, 192, 384, 768)
    depths: tuple = (2, 2, 6, 2)
    classes: int = 1000
    layer_scale: float = 1e-6
    dtype: str = "float32"


QUICK = Config(batch=2, image=16, dims=(8, 16), depths=(1, 1), classes=10)


class Block(nnx.Module):
    def __init__(self, dim: int, c: Config, rngs: nnx.Rngs):
        self.depthwise = nnx.Conv(dim, dim, (7, 7), feature_group_count=dim, dtype=c.dtype, rngs=rngs)
        self.norm = nnx.LayerNorm(dim, epsilon=1e-6, dtype=c.dtype, rngs=rngs)
        self.expand = nnx.Linear(dim, 4 * dim, dtype=c.dtype, rngs=rngs)
        self.project = nnx.Linear(4 * dim, dim, dtype=c.dtype, rngs=rngs)
        self.scale = nnx.Param(jnp.full((dim,), c.layer_scale, jnp.float32))

    def __call__(self, x):
        y = self.expand(self.norm(self.depthwise(x)))
        y = self.project(jax.nn.gelu(y, approximate=False))
        return x + (self.scale[...] * y).astype(x.dtype)


class ConvNeXt(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        d0 = c.dims[0]
        self.stem = nnx.Conv(3, d0, (c.patch, c.patch), strides=c.patch, padding="VALID", dtype=c.dtype,
                             rngs=rngs)
        self.stem_norm = nnx.LayerNorm(d0, epsilon=1e-6, dtype=c.dtype, rngs=rngs)
        self.down_norms = nnx.List([nnx.LayerNorm(a, epsilon=1e-6, dtype=c.dtype, rngs=rngs)
                                    for a in c.dims[:-1]])
        self.downs = nnx.List([nnx.Conv(a, b, (2, 2), strides=2, padding="VALID", dtype=c.dtype, rngs=rngs)
                               for a, b in zip(c.dims[:-1], c.dims[1:])])
        self.stages = nnx.List([nnx.List([Block(d, c, rngs) for _ in range(n)])
                                for d, n in zip(c.dims, c.depths)])
        self.norm = nnx.LayerNorm(c.dims[-1], epsilon=1e-6, dtype=c.dtype, rngs=rngs)
        self.head = nnx.Linear(c.dims[-1], c.classes, dtype=c.dtype, rngs=rngs)

    def __call__(self, images):
        x = self.stem_norm(self.stem(images))
        for i, stage in enumerate(self.stages):
            if i:
                x = self.downs[i - 1](self.down_norms[i - 1](x))
            for block in stage:
                x = block(x)
        return self.head(self.norm(x.mean(axis=(1, 2)))).astype(jnp.float32)


def make_init(c: Config, seed: int):
    return common.train_init(lambda: ConvNeXt(c, nnx.Rngs(params=seed)), optax.adamw(1e-3, weight_decay=0.05))


def make_infer_init(c: Config, seed: int):
    return common.initializer(lambda: ConvNeXt(c, nnx.Rngs(params=seed)))


make_batches = common.image_batches
evaluate = common.classify_images


def loss(model, batch):
    return evaluate(model, batch)[0]


train_step = common.train_step(loss)
infer_step = common.infer_step(evaluate)
