"""What the zoo's models share: the shape of a train step and of an inference step, and a few layers
that several families use."""
from __future__ import annotations

import functools
import math
import os
import sys

import jax
import jax.numpy as jnp
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_harness  # noqa: E402


# XLA options for programs compiled on a CPU where the compile time matters more than the code:
# a third of the default compile time for the zoo's tiny models.
CPU_QUICK_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


def train_step(loss):
    """`step(graphdef, state, batch) -> (loss, new_state)` minimising `loss(model, batch)`, as the
    repository's train examples have it (train_harness.nnx_train_step)."""
    return train_harness.nnx_train_step(loss)


def infer_step(evaluate):
    """`step(graphdef, state, batch) -> (loss, predictions)` of a model alone (no optimizer): a
    forward pass whose state is only read. The loss lets two compilers' outputs be compared as the
    train steps' are; the predictions are what serving would return."""
    def step(graphdef, state, batch):
        return evaluate(nnx.merge(graphdef, state), batch)
    return step


def initializer(build):
    """A function giving `(graphdef, state)` of the NNX objects `build()` makes, their arrays drawn by
    one compiled program: a deep model's init op by op is thousands of small eager computations
    (seconds on a CPU). Each call gives fresh arrays with the same values."""
    graphdefs = []
    # (on a CPU, XLA's backend optimisations and fusion emitters take most of the init's compile)
    cheap = CPU_QUICK_COMPILE if jax.default_backend() == "cpu" else None

    @functools.partial(jax.jit, compiler_options=cheap)
    def make_state():
        graphdef, state = nnx.split(build())
        graphdefs.append(graphdef)  # (traced once: the graph definition is static)
        return state

    def init():
        state = make_state()
        return graphdefs[-1], state

    def abstract():
        """(graphdef, the state's shapes and dtypes): enough to plan a step, nothing drawn."""
        shapes = jax.eval_shape(make_state)
        return graphdefs[-1], shapes

    init.abstract = abstract
    return init


def train_init(build, tx: optax.GradientTransformation):
    """The init of a train step: the model `build()` makes and its optimizer `tx` (over the
    `nnx.Param`s), split together."""
    def pair():
        model = build()
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)
    return initializer(pair)


def classify(logits, labels):
    """(mean cross-entropy, argmax predictions) of float32 logits."""
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, jnp.argmax(logits, axis=-1).astype(jnp.int32)


def image_batches(c, seed: int):
    """`batch(i)`: `c.batch` random `c.image` x `c.image` RGB images (NHWC, `c.dtype`) and labels
    among `c.classes` (the image classifiers' data)."""
    def batch(i):
        k1, k2 = jax.random.split(jax.random.fold_in(jax.random.key(seed), i))
        images = jax.random.normal(k1, (c.batch, c.image, c.image, 3)).astype(c.dtype)
        return {"images": images, "labels": jax.random.randint(k2, (c.batch,), 0, c.classes)}
    return batch


def classify_images(model, batch):
    """(mean cross-entropy, predicted classes) of an image classifier on an image_batches batch."""
    return classify(model(batch["images"]), batch["labels"])


def token_batches(c, seed: int):
    """`batch(i)`: `c.batch` random sequences of `c.seq + 1` tokens among `c.vocab` (the language
    models' data: each position's next token is its label)."""
    def batch(i):
        key = jax.random.fold_in(jax.random.key(seed), i)
        return {"tokens": jax.random.randint(key, (c.batch, c.seq + 1), 0, c.vocab)}
    return batch


def next_token(model, batch):
    """(next-token cross-entropy, each position's predicted token) of a forward pass (prefill) over a
    token_batches batch."""
    return classify(model(batch["tokens"][:, :-1]), batch["tokens"][:, 1:])


def attention(q, k, v, bias=None, scale: float | None = None):
    """Softmax attention over [batch, seq, heads, head] queries, keys and values; `bias` is added to
    the float32 logits (a mask as -1e9 or learned position biases). The softmax runs in float32 and
    its probabilities go back to the activations' dtype for the second product."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
    if bias is not None:
        logits = logits + bias
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def count_params(state) -> int:
    """Parameters in an NNX state (the model's `nnx.Param`s only, not optimizer or statistics)."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.filter_state(state, nnx.Param)))
