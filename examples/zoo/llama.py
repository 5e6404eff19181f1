"""A Llama-style decoder (Touvron et al. 2023): pre-norm blocks of RMSNorm, grouped-query causal
attention with rotary position embeddings, and a SwiGLU MLP; an untied output projection and
next-token cross-entropy over a 32k vocabulary. AdamW.

4 layers, hidden 1024, 16 query heads sharing 4 key/value heads (head 64), MLP 2816, sequences of
1024 tokens, batch 8. The RMSNorms, rotary rotations, the causal softmax over 1024 x 1024 logits per
head and the cross-entropy over 8192 x 32000 logits are the memory-bound part.
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
    layers: int = 4
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 4
    mlp: int = 2816
    vocab: int = 32000
    seq: int = 1024
    batch: int = 8
    rope_base: float = 10000.0
    dtype: str = "float32"


QUICK = Config(layers=1, hidden=32, heads=4, kv_heads=2, mlp=64, vocab=128, seq=16, batch=2)


def rope(x, base: float):
    """Rotary embedding of [batch, seq, heads, head] as Llama's reference code has it: consecutive
    feature pairs (x[2i], x[2i+1]) rotated by position * base^(-2i/head), in float32."""
    seq, head = x.shape[1], x.shape[-1]
    freqs = base ** (-jnp.arange(0, head, 2, dtype=jnp.float32) / head)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs    # [seq, head / 2]
    cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], head // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention: each key/value head serves heads // kv_heads query heads."""

    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.c = c
        head = c.hidden // c.heads
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=c.dtype, rngs=rngs)  # noqa: E731
        self.q, self.o = linear(c.hidden, c.hidden), linear(c.hidden, c.hidden)
        self.k, self.v = linear(c.hidden, c.kv_heads * head), linear(c.hidden, c.kv_heads * head)

    def __call__(self, x):
        c, (b, s, _) = self.c, x.shape
        head, group = c.hidden // c.heads, c.heads // c.kv_heads
        q = rope(self.q(x).reshape(b, s, c.heads, head), c.rope_base)
        k = rope(self.k(x).reshape(b, s, c.kv_heads, head), c.rope_base)
        v = self.v(x).reshape(b, s, c.kv_heads, head)
        q = q.reshape(b, s, c.kv_heads, group, head)
        logits = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32) / jnp.sqrt(float(head))
        causal = jnp.tril(jnp.ones((s, s), bool))
        probs = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1).astype(x.dtype)
        out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
        return self.o(out.reshape(b, s, c.hidden))


class SwiGLU(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.gate = nnx.Linear(c.hidden, c.mlp, use_bias=False, dtype=c.dtype, rngs=rngs)
        self.up = nnx.Linear(c.hidden, c.mlp, use_bias=False, dtype=c.dtype, rngs=rngs)
        self.down = nnx.Linear(c.mlp, c.hidden, use_bias=False, dtype=c.dtype, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(c.hidden, epsilon=1e-5, dtype=c.dtype, rngs=rngs)
        self.attn = Attention(c, rngs)
        self.mlp_norm = nnx.RMSNorm(c.hidden, epsilon=1e-5, dtype=c.dtype, rngs=rngs)
        self.mlp = SwiGLU(c, rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.embed = nnx.Embed(c.vocab, c.hidden, dtype=c.dtype, rngs=rngs)
        self.blocks = nnx.List([Block(c, rngs) for _ in range(c.layers)])
        self.norm = nnx.RMSNorm(c.hidden, epsilon=1e-5, dtype=c.dtype, rngs=rngs)
        self.output = nnx.Linear(c.hidden, c.vocab, use_bias=False, dtype=c.dtype, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.output(self.norm(x)).astype(jnp.float32)


def make_init(c: Config, seed: int):
    return common.train_init(lambda: Llama(c, nnx.Rngs(params=seed)), optax.adamw(3e-4, b2=0.95, weight_decay=0.1))


def make_infer_init(c: Config, seed: int):
    return common.initializer(lambda: Llama(c, nnx.Rngs(params=seed)))


make_batches = common.token_batches
evaluate = common.next_token


train_step = common.train_step(lambda model, batch: evaluate(model, batch)[0])
infer_step = common.infer_step(evaluate)
