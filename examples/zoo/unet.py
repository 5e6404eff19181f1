"""A diffusion U-Net (Ho et al. 2020's DDPM network, two resolutions) on latent-sized images.

Residual blocks of GroupNorm, SiLU and 3x3 convolutions with the timestep's embedding added between
them; self-attention over the spatial positions at the lower resolution (and in the middle); skip
connections concatenated on the way up. The loss is DDPM's: predict the noise mixed into a clean
image at a random timestep of a linear schedule (mean squared error). AdamW. GroupNorm and SiLU
surround every convolution, so normalisation statistics over (H, W, channels of a group) and their
backward passes are a large share of the step.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from . import common

TIMESTEPS = 1000  # the noise schedule's length (DDPM's linear betas)


@dataclasses.dataclass(frozen=True)
class Config:
    batch: int = 64
    image: int = 32
    channels: int = 4       # latent channels
    width: int = 128        # channels at full resolution; twice that at half
    groups: int = 32
    heads: int = 4
    dtype: str = "float32"


QUICK = Config(batch=2, image=8, width=16, groups=4, heads=2)


def timestep_features(t, dim: int):
    """Sinusoidal features of integer timesteps [batch] -> [batch, dim] (Transformer-style)."""
    half = dim // 2
    freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
    angles = t.astype(jnp.float32)[:, None] * freqs
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class ResBlock(nnx.Module):
    def __init__(self, cin: int, cout: int, c: Config, rngs: nnx.Rngs):
        self.norm1 = nnx.GroupNorm(cin, num_groups=c.groups, dtype=c.dtype, rngs=rngs)
        self.conv1 = nnx.Conv(cin, cout, (3, 3), dtype=c.dtype, rngs=rngs)
        self.time = nnx.Linear(4 * c.width, cout, dtype=c.dtype, rngs=rngs)
        self.norm2 = nnx.GroupNorm(cout, num_groups=c.groups, dtype=c.dtype, rngs=rngs)
        self.conv2 = nnx.Conv(cout, cout, (3, 3), dtype=c.dtype, rngs=rngs)
        self.skip = nnx.Conv(cin, cout, (1, 1), dtype=c.dtype, rngs=rngs) if cin != cout else None

    def __call__(self, x, temb):
        h = self.conv1(jax.nn.silu(self.norm1(x)))
        h = h + self.time(jax.nn.silu(temb))[:, None, None, :]
        h = self.conv2(jax.nn.silu(self.norm2(h)))
        return h + (x if self.skip is None else self.skip(x))


class SpatialAttention(nnx.Module):
    """Multi-head self-attention among the H x W positions of a feature map, pre-normed by a
    GroupNorm, added back to its input."""

    def __init__(self, dim: int, c: Config, rngs: nnx.Rngs):
        self.heads = c.heads
        self.norm = nnx.GroupNorm(dim, num_groups=c.groups, dtype=c.dtype, rngs=rngs)
        self.qkv = nnx.Linear(dim, 3 * dim, dtype=c.dtype, rngs=rngs)
        self.out = nnx.Linear(dim, dim, dtype=c.dtype, rngs=rngs)

    def __call__(self, x):
        b, h, w, d = x.shape
        qkv = self.qkv(self.norm(x)).reshape(b, h * w, 3, self.heads, d // self.heads)
        y = common.attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
        return x + self.out(y.reshape(b, h, w, d))


class UNet(nnx.Module):
    """Two resolutions: a residual block at full size, one at half size (twice the channels) with
    self-attention, a middle block, and on the way up a residual block per resolution, each over its
    input concatenated with the skip from the way down."""

    def __init__(self, c: Config, rngs: nnx.Rngs):
        w, dt = c.width, c.dtype
        self.width = w
        self.temb1 = nnx.Linear(w, 4 * w, dtype=dt, rngs=rngs)
        self.temb2 = nnx.Linear(4 * w, 4 * w, dtype=dt, rngs=rngs)
        self.conv_in = nnx.Conv(c.channels, w, (3, 3), dtype=dt, rngs=rngs)
        self.down0 = ResBlock(w, w, c, rngs)
        self.downsample = nnx.Conv(w, w, (3, 3), strides=2, dtype=dt, rngs=rngs)
        self.down1, self.attn = ResBlock(w, 2 * w, c, rngs), SpatialAttention(2 * w, c, rngs)
        self.mid, self.up1 = ResBlock(2 * w, 2 * w, c, rngs), ResBlock(4 * w, 2 * w, c, rngs)
        self.upsample = nnx.Conv(2 * w, 2 * w, (3, 3), dtype=dt, rngs=rngs)
        self.up0 = ResBlock(3 * w, w, c, rngs)
        self.norm_out = nnx.GroupNorm(w, num_groups=c.groups, dtype=dt, rngs=rngs)
        self.conv_out = nnx.Conv(w, c.channels, (3, 3), dtype=dt, rngs=rngs)

    def __call__(self, x, t):
        temb = self.temb2(jax.nn.silu(self.temb1(timestep_features(t, self.width).astype(x.dtype))))
        skip0 = self.down0(self.conv_in(x), temb)                               # full resolution
        skip1 = self.attn(self.down1(self.downsample(skip0), temb))             # half resolution
        h = self.up1(jnp.concatenate([self.mid(skip1, temb), skip1], axis=-1), temb)
        h = self.upsample(jnp.repeat(jnp.repeat(h, 2, axis=1), 2, axis=2))   # nearest-neighbour 2x
        h = self.up0(jnp.concatenate([h, skip0], axis=-1), temb)
        return self.conv_out(jax.nn.silu(self.norm_out(h)))


def make_init(c: Config, seed: int):
    return common.train_init(lambda: UNet(c, nnx.Rngs(params=seed)), optax.adamw(2e-4, weight_decay=0.01))


def make_batches(c: Config, seed: int):
    """Clean images, the noise mixed in and the timesteps; the noising itself is in the loss."""
    def batch(i):
        k1, k2, k3 = jax.random.split(jax.random.fold_in(jax.random.key(seed), i), 3)
        shape = (c.batch, c.image, c.image, c.channels)
        return {"images": jax.random.normal(k1, shape).astype(c.dtype),
                "noise": jax.random.normal(k2, shape).astype(c.dtype),
                "t": jax.random.randint(k3, (c.batch,), 0, TIMESTEPS)}
    return batch


def loss(model, batch):
    betas = jnp.linspace(1e-4, 0.02, TIMESTEPS, dtype=jnp.float32)
    keep = jnp.cumprod(1.0 - betas)[batch["t"]][:, None, None, None]  # alpha-bar at each timestep
    x0, eps = batch["images"].astype(jnp.float32), batch["noise"].astype(jnp.float32)
    noisy = (jnp.sqrt(keep) * x0 + jnp.sqrt(1.0 - keep) * eps).astype(batch["images"].dtype)
    predicted = model(noisy, batch["t"]).astype(jnp.float32)
    return jnp.mean(jnp.square(predicted - eps))


train_step = common.train_step(loss)
