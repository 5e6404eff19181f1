"""A GPT-style decoder (Flax NNX + optax AdamW) trained under jax.jit and jaxstitch.jit.

Pre-norm decoder blocks as in LLaMA: RMSNorm, rotary position embeddings on queries and keys, causal
attention, a SwiGLU MLP, and cross-entropy over a 32k vocabulary with an untied output projection.
12 layers, hidden 768, 12 heads, MLP 2048, sequences of 512 tokens, batch 8. Data is synthetic, from
the seed. Prints step times, compile times, kernel counts and whether 100 steps give the same losses.

    python examples/gpt_train.py                     # batch 8 x 512
    python examples/gpt_train.py --dtype bfloat16    # mixed precision
    python examples/gpt_train.py --quick             # a tiny model (runs anywhere)
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
    layers: int = 12
    hidden: int = 768
    heads: int = 12
    mlp: int = 2048
    vocab: int = 32000
    seq: int = 512
    batch: int = 8
    rope_base: float = 10000.0
    dtype: str = "float32"  # activations and matrix products; parameters and optimizer stay float32


QUICK = Config(layers=2, hidden=128, heads=4, mlp=256, vocab=1000, seq=64, batch=4)


def rotary(x, positions, base: float):
    """Rotate each head's feature pairs (first half, second half) by position-dependent angles."""
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, None].astype(jnp.float32) * freqs  # [seq, half]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]  # broadcast over heads
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.c = c
        self.qkv = nnx.Linear(c.hidden, 3 * c.hidden, use_bias=False, dtype=c.dtype, rngs=rngs)
        self.out = nnx.Linear(c.hidden, c.hidden, use_bias=False, dtype=c.dtype, rngs=rngs)

    def __call__(self, x):
        b, s, _ = x.shape
        head = self.c.hidden // self.c.heads
        q, k, v = jnp.split(self.qkv(x).reshape(b, s, 3 * self.c.heads, head), 3, axis=2)
        positions = jnp.arange(s)
        q, k = rotary(q, positions, self.c.rope_base), rotary(k, positions, self.c.rope_base)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head).astype(x.dtype)
        causal = jnp.tril(jnp.ones((s, s), bool))
        scores = jnp.where(causal, scores.astype(jnp.float32), -1e9)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1))


class SwiGLU(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.gate = nnx.Linear(c.hidden, c.mlp, use_bias=False, dtype=c.dtype, rngs=rngs)
        self.up = nnx.Linear(c.hidden, c.mlp, use_bias=False, dtype=c.dtype, rngs=rngs)
        self.down = nnx.Linear(c.mlp, c.hidden, use_bias=False, dtype=c.dtype, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.norm1 = nnx.RMSNorm(c.hidden, epsilon=1e-6, dtype=c.dtype, rngs=rngs)
        self.attn = Attention(c, rngs)
        self.norm2 = nnx.RMSNorm(c.hidden, epsilon=1e-6, dtype=c.dtype, rngs=rngs)
        self.mlp = SwiGLU(c, rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.embed = nnx.Embed(c.vocab, c.hidden, dtype=c.dtype, rngs=rngs)
        self.blocks = nnx.List([Block(c, rngs) for _ in range(c.layers)])
        self.norm = nnx.RMSNorm(c.hidden, epsilon=1e-6, dtype=c.dtype, rngs=rngs)
        self.lm_head = nnx.Linear(c.hidden, c.vocab, use_bias=False, dtype=c.dtype, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x)).astype(jnp.float32)


def make_init(c: Config, seed: int):
    def init():
        model = GPT(c, nnx.Rngs(params=seed))
        optimizer = nnx.Optimizer(model, optax.adamw(3e-4, weight_decay=0.1), wrt=nnx.Param)
        return nnx.split((model, optimizer))
    return init


def make_batches(c: Config, seed: int):
    def batch(i):
        key = jax.random.fold_in(jax.random.key(seed), i)
        return {"tokens": jax.random.randint(key, (c.batch, c.seq + 1), 0, c.vocab)}
    return batch


def loss(model, batch):
    inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(model(inputs), targets).mean()


train_step = train_harness.nnx_train_step(loss)


def main():
    args = train_harness.parser(__doc__.splitlines()[0], dtype=True).parse_args()
    c = train_harness.configured(args, Config(), QUICK)
    train_harness.main("GPT decoder train step", sys.modules[__name__], args, c)


if __name__ == "__main__":
    main()
