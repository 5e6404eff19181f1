"""BERT-base masked-LM training (Flax NNX + optax AdamW) under jax.jit and jaxstitch.jit.

12 layers, hidden 768, 12 heads, MLP 3072, vocabulary 30522, sequences of 128 tokens, 20 masked
positions each (BERT's pre-training recipe); dropout 0.1, layernorm, GELU. Data is synthetic, from the
seed. Prints step times, compile times, kernel counts and whether 100 steps give the same losses.

    python examples/bert_train.py            # BERT-base, batch 32
    python examples/bert_train.py --dtype bfloat16   # mixed precision
    python examples/bert_train.py --quick    # a tiny model (runs anywhere)
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

MASK_TOKEN = 103


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int = 12
    hidden: int = 768
    heads: int = 12
    mlp: int = 3072
    vocab: int = 30522
    seq: int = 128
    batch: int = 32
    predictions: int = 20
    dropout: float = 0.1
    dtype: str = "float32"  # activations and matrix products; parameters and optimizer stay float32


QUICK = Config(layers=2, hidden=128, heads=4, mlp=512, vocab=1000, seq=32, batch=8, predictions=5)


class EncoderLayer(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.attn = nnx.MultiHeadAttention(num_heads=c.heads, in_features=c.hidden, dropout_rate=c.dropout,
                                           decode=False, dtype=c.dtype, rngs=rngs)
        self.ln1 = nnx.LayerNorm(c.hidden, epsilon=1e-12, dtype=c.dtype, rngs=rngs)
        self.fc1 = nnx.Linear(c.hidden, c.mlp, dtype=c.dtype, rngs=rngs)
        self.fc2 = nnx.Linear(c.mlp, c.hidden, dtype=c.dtype, rngs=rngs)
        self.ln2 = nnx.LayerNorm(c.hidden, epsilon=1e-12, dtype=c.dtype, rngs=rngs)
        self.drop = nnx.Dropout(c.dropout, rngs=rngs)

    def __call__(self, x):
        x = self.ln1(x + self.drop(self.attn(x, deterministic=False)))
        return self.ln2(x + self.drop(self.fc2(jax.nn.gelu(self.fc1(x)))))


class Bert(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.tokens = nnx.Embed(c.vocab, c.hidden, dtype=c.dtype, rngs=rngs)
        self.positions = nnx.Embed(c.seq, c.hidden, dtype=c.dtype, rngs=rngs)
        self.ln = nnx.LayerNorm(c.hidden, epsilon=1e-12, dtype=c.dtype, rngs=rngs)
        self.drop = nnx.Dropout(c.dropout, rngs=rngs)
        self.layers = nnx.List([EncoderLayer(c, rngs) for _ in range(c.layers)])
        self.head = nnx.Linear(c.hidden, c.hidden, dtype=c.dtype, rngs=rngs)
        self.head_ln = nnx.LayerNorm(c.hidden, epsilon=1e-12, dtype=c.dtype, rngs=rngs)
        self.out_bias = nnx.Param(jnp.zeros((c.vocab,)))

    def __call__(self, tokens, masked_at):
        x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1]))[None]
        x = self.drop(self.ln(x))
        for layer in self.layers:
            x = layer(x)
        x = jnp.take_along_axis(x, masked_at[..., None], axis=1)  # [batch, predictions, hidden]
        x = self.head_ln(jax.nn.gelu(self.head(x)))
        return self.tokens.attend(x).astype(jnp.float32) + self.out_bias  # tied to the embedding


def make_init(c: Config, seed: int):
    def init():
        model = Bert(c, nnx.Rngs(params=seed, dropout=seed + 1))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-4, weight_decay=0.01), wrt=nnx.Param)
        return nnx.split((model, optimizer))
    return init


def make_batches(c: Config, seed: int):
    def batch(i):
        k1, k2 = jax.random.split(jax.random.fold_in(jax.random.key(seed), i))
        tokens = jax.random.randint(k1, (c.batch, c.seq), c.vocab // 30, c.vocab)  # (above [MASK])
        masked_at = jnp.sort(jax.random.permutation(k2, c.seq)[:c.predictions])[None].repeat(c.batch, 0)
        labels = jnp.take_along_axis(tokens, masked_at, axis=1)
        rows = jnp.arange(c.batch)[:, None]
        return {"tokens": tokens.at[rows, masked_at].set(MASK_TOKEN), "masked_at": masked_at, "labels": labels}
    return batch


def loss(model, batch):
    logits = model(batch["tokens"], batch["masked_at"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


train_step = train_harness.nnx_train_step(loss)


def main():
    args = train_harness.parser(__doc__.splitlines()[0], dtype=True).parse_args()
    c = train_harness.configured(args, Config(), QUICK)
    train_harness.main("BERT masked-LM train step", sys.modules[__name__], args, c)


if __name__ == "__main__":
    main()
