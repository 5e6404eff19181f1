"""A Mamba-style selective state-space language model (Gu & Dao 2023), its recurrence in `lax.scan`.

A block: RMSNorm, an input projection to two branches of width 2 x hidden, a causal depthwise
convolution (4 taps) and SiLU on one, then the selective scan: per step t and channel e a 16-wide
state h <- exp(dt_t[e] * A[e]) * h + dt_t[e] * x_t[e] * B_t, read out as y_t[e] = C_t . h + D[e] x_t[e],
with dt, B and C computed from the input (softplus for dt). The other branch gates the result by SiLU
before an output projection and the residual add. The scan runs in float32 whatever the activations,
as Mamba's kernels do; its body is all elementwise work and a 16-wide sum per channel, one step at a
time: the kind of recurrence jaxstitch's persistent scans are for. Tied embeddings, next-token
cross-entropy, AdamW.

2 layers, hidden 512 (scan width 1024, state 16), vocabulary 8192, batch 16 x 256 tokens.
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
    layers: int = 2
    hidden: int = 512
    expand: int = 2
    state: int = 16
    taps: int = 4
    vocab: int = 8192
    seq: int = 256
    batch: int = 16
    dtype: str = "float32"


QUICK = Config(layers=1, hidden=16, state=4, vocab=64, seq=8, batch=2)


def selective_scan(x, dt, A, B, C):
    """y [batch, seq, width] of the recurrence above, from x and dt [batch, seq, width], A [width,
    state], B and C [batch, seq, state]; float32 throughout."""
    def step(h, inputs):
        x_t, dt_t, b_t, c_t = inputs
        h = jnp.exp(dt_t[..., None] * A) * h + (dt_t * x_t)[..., None] * b_t[:, None, :]
        return h, jnp.sum(h * c_t[:, None, :], axis=-1)

    time_major = [jnp.swapaxes(a.astype(jnp.float32), 0, 1) for a in (x, dt, B, C)]
    h0 = jnp.zeros((x.shape[0], x.shape[2], A.shape[1]), jnp.float32)
    _, ys = jax.lax.scan(step, h0, time_major)
    return jnp.swapaxes(ys, 0, 1)


class MambaBlock(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        width, self.rank, self.state = c.expand * c.hidden, max(1, c.hidden // 16), c.state
        self.norm = nnx.RMSNorm(c.hidden, epsilon=1e-5, dtype=c.dtype, rngs=rngs)
        self.inputs = nnx.Linear(c.hidden, 2 * width, use_bias=False, dtype=c.dtype, rngs=rngs)
        self.conv = nnx.Conv(width, width, (c.taps,), feature_group_count=width, padding=((c.taps - 1, 0),),
                             dtype=c.dtype, rngs=rngs)
        self.select = nnx.Linear(width, self.rank + 2 * c.state, use_bias=False, dtype=c.dtype, rngs=rngs)
        # dt's bias starts at softplus^-1 of steps spread over [0.001, 0.1] (log-uniform), as Mamba's
        steps = jnp.exp(jnp.linspace(jnp.log(1e-3), jnp.log(0.1), width))
        self.dt = nnx.Linear(self.rank, width, dtype=c.dtype, rngs=rngs,
                             bias_init=lambda *_: steps + jnp.log(-jnp.expm1(-steps)))
        self.A_log = nnx.Param(jnp.log(jnp.broadcast_to(jnp.arange(1, c.state + 1, dtype=jnp.float32),
                                                        (width, c.state))))
        self.D = nnx.Param(jnp.ones((width,), jnp.float32))
        self.outputs = nnx.Linear(width, c.hidden, use_bias=False, dtype=c.dtype, rngs=rngs)

    def __call__(self, x):
        u, gate = jnp.split(self.inputs(self.norm(x)), 2, axis=-1)
        u = jax.nn.silu(self.conv(u))
        dt, B, C = jnp.split(self.select(u), [self.rank, self.rank + self.state], axis=-1)
        dt = jax.nn.softplus(self.dt(dt).astype(jnp.float32))
        y = selective_scan(u, dt, -jnp.exp(self.A_log[...]), B, C) + self.D[...] * u.astype(jnp.float32)
        return x + self.outputs((y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype))


class MambaLM(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.embed = nnx.Embed(c.vocab, c.hidden, dtype=c.dtype, rngs=rngs)
        self.blocks = nnx.List([MambaBlock(c, rngs) for _ in range(c.layers)])
        self.norm = nnx.RMSNorm(c.hidden, epsilon=1e-5, dtype=c.dtype, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x)).astype(jnp.float32)


def make_init(c: Config, seed: int):
    return common.train_init(lambda: MambaLM(c, nnx.Rngs(params=seed)), optax.adamw(1e-3, weight_decay=0.1))


make_batches = common.token_batches


def loss(model, batch):
    return common.next_token(model, batch)[0]


train_step = common.train_step(loss)
