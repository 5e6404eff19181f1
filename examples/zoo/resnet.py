"""A BatchNorm ResNet for CIFAR-sized images (He et al. 2016; the CIFAR variant of ResNet-18).

NHWC images, 3x3 stem, four stages of two basic blocks (64, 128, 256, 512 channels, stride 2 between
stages), BatchNorm in training mode with running statistics, ReLU, residual adds, 1x1 projection
shortcuts where the shape changes, global average pooling and a linear classifier; SGD with Nesterov
momentum and weight decay. Every convolution is followed by a normalisation and most by a ReLU: the
memory-bound part is BatchNorm's statistics, normalisation and their backward passes.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from . import common


@dataclasses.dataclass(frozen=True)
class Config:
    batch: int = 128
    image: int = 32
    widths: tuple = (64, 128, 256, 512)
    blocks: tuple = (2, 2, 2, 2)
    classes: int = 10
    dtype: str = "float32"  # activations and convolutions; parameters and optimizer stay float32


QUICK = Config(batch=4, image=8, widths=(8, 16), blocks=(1, 1))


class Block(nnx.Module):
    """Two 3x3 convolutions, each normalised, with the input added back (projected when the
    stride or the width changes)."""

    def __init__(self, cin: int, cout: int, stride: int, c: Config, train: bool, rngs: nnx.Rngs):
        conv = functools.partial(nnx.Conv, use_bias=False, dtype=c.dtype, rngs=rngs)
        norm = functools.partial(nnx.BatchNorm, use_running_average=not train, momentum=0.9,
                                 dtype=c.dtype, rngs=rngs)
        self.conv1, self.bn1 = conv(cin, cout, (3, 3), strides=stride), norm(cout)
        self.conv2, self.bn2 = conv(cout, cout, (3, 3)), norm(cout)
        reshaped = stride != 1 or cin != cout
        self.project = nnx.Sequential(conv(cin, cout, (1, 1), strides=stride), norm(cout)) if reshaped else None

    def __call__(self, x):
        y = jax.nn.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return jax.nn.relu(y + (x if self.project is None else self.project(x)))


class ResNet(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs, train: bool = True):
        self.stem = nnx.Conv(3, c.widths[0], (3, 3), use_bias=False, dtype=c.dtype, rngs=rngs)
        self.bn = nnx.BatchNorm(c.widths[0], use_running_average=not train, momentum=0.9, dtype=c.dtype,
                                rngs=rngs)
        blocks, cin = [], c.widths[0]
        for stage, (width, n) in enumerate(zip(c.widths, c.blocks)):
            for i in range(n):
                blocks.append(Block(cin, width, 2 if stage and not i else 1, c, train, rngs))
                cin = width
        self.blocks = nnx.List(blocks)
        self.head = nnx.Linear(cin, c.classes, dtype=c.dtype, rngs=rngs)

    def __call__(self, images):
        x = jax.nn.relu(self.bn(self.stem(images)))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=(1, 2))).astype(jnp.float32)


def make_init(c: Config, seed: int):
    # (0.01: on the synthetic batches, 0.05 drove the float32 loss from 2.48 to 10.6 in 8 steps under
    # jax.jit, so two compilers' curves parted by 20% from roundings alone; 0.01 stays near ln 10)
    tx = optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(0.01, momentum=0.9, nesterov=True))
    return common.train_init(lambda: ResNet(c, nnx.Rngs(params=seed)), tx)


def make_infer_init(c: Config, seed: int):
    """The model alone, its BatchNorms reading the running statistics (inference)."""
    return common.initializer(lambda: ResNet(c, nnx.Rngs(params=seed), train=False))


make_batches = common.image_batches
evaluate = common.classify_images


def loss(model, batch):
    return evaluate(model, batch)[0]


train_step = common.train_step(loss)
infer_step = common.infer_step(evaluate)
