"""Benchmark workloads: memory-bound model pieces where XLA splits kernels and AStitch stitches them.

Each `Workload` holds a plain (not jitted) JAX function and a way to draw its inputs. The model code
(layer norm, RMS norm, softmax, cross-entropy, bias-GELU-dropout) is written as named top-level
functions, so tests and examples can use them directly. Half-precision inputs are upcast to float32 for
the statistics and cast back, as Flax does.

Sizes: "full" shapes move tens of MB to ~1 GB per call (sized for an H100/H200); "quick" shapes a few
MB (CPU tests, smoke runs).
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp

F32 = jnp.float32
LN_EPS = 1e-5
RMS_EPS = 1e-6
VOCAB = 32000
DROPOUT_RATE = 0.1


# ----------------------------------------------------------------------------------------------------
# Model code
# ----------------------------------------------------------------------------------------------------

def layernorm(x, gamma, beta, eps=LN_EPS):
    """Layer norm over the last axis, statistics in float32; returns x.dtype."""
    xf = x.astype(F32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * gamma.astype(F32) + beta.astype(F32)
    return y.astype(x.dtype)


def rmsnorm(h, w, eps=RMS_EPS):
    """RMS norm over the last axis, statistics in float32; returns h.dtype."""
    hf = h.astype(F32)
    ms = jnp.mean(jnp.square(hf), axis=-1, keepdims=True)
    y = hf * jax.lax.rsqrt(ms + eps) * w.astype(F32)
    return y.astype(h.dtype)


def residual_rmsnorm(x, residual, w):
    """Pre-norm transformer block entry: h = x + residual, y = rmsnorm(h) * w. Returns (y, h)."""
    h = x + residual
    return rmsnorm(h, w), h


HEAD_DIM = 128


def rotary(x, cos, sin):
    """Rotary position embedding of [tokens, heads, HEAD_DIM] values (the halves rotated, as in
    GPT-NeoX and Llama), in float32; cos and sin are [tokens, HEAD_DIM / 2]."""
    h = x.shape[-1] // 2
    xf = x.astype(F32)
    x1, x2 = xf[..., :h], xf[..., h:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def rmsnorm_rope(x, w, cos, sin):
    """A GPT-style query's path into attention: RMS norm (QK-norm), heads, rotary embedding."""
    y = rmsnorm(x, w)
    return rotary(y.reshape(x.shape[0], -1, HEAD_DIM), cos, sin)


def softmax(x):
    """Softmax over the last axis in float32; returns x.dtype."""
    return jax.nn.softmax(x.astype(F32), axis=-1).astype(x.dtype)


TOP_P = 0.9


def top_p_filter(sorted_logits, top_p=TOP_P):
    """Nucleus sampling's filter over logits sorted in descending order (the sort is XLA's): the
    probabilities of the smallest prefix whose mass reaches `top_p`, renormalized; in float32,
    returns the logits' dtype."""
    p = jax.nn.softmax(sorted_logits.astype(F32), axis=-1)
    before = jnp.cumsum(p, axis=-1) - p  # the mass of the tokens ahead of each one
    kept = jnp.where(before < top_p, p, 0.0)
    return (kept / jnp.sum(kept, axis=-1, keepdims=True)).astype(sorted_logits.dtype)


def token_logprob(logits, targets):
    """log p(target) per row, in float32: a log-softmax over the vocabulary and a pick of the
    target's entry, written as a masked row sum (a language model's scoring service: perplexity,
    reranking)."""
    lf = logits.astype(F32)
    picked = jnp.arange(lf.shape[-1]) == targets[:, None]
    return jnp.sum(jnp.where(picked, jax.nn.log_softmax(lf, axis=-1), 0.0), axis=-1)


def survival(hazard_logits):
    """Discrete-time survival: S_t = exp(-sum_{s <= t} softplus(x_s)) over the last axis (time
    steps), in float32; returns the input's dtype."""
    h = jax.nn.softplus(hazard_logits.astype(F32))
    return jnp.exp(-jnp.cumsum(h, axis=-1)).astype(hazard_logits.dtype)


def survival_fwdbwd(hazard_logits, dy):
    """The survival curve and its gradient: the backward pass of a cumsum is a reverse cumsum."""
    out, vjp = jax.vjp(survival, hazard_logits)
    return out, vjp(dy)[0]


def top1_pair(a, b):
    """A combiner for `lax.reduce` over (value, index) pairs: the larger value, the smaller index
    among equal values. Argmax and its value in one variadic reduce."""
    (av, ai), (bv, bi) = a, b
    take = (bv > av) | ((bv == av) & (bi < ai))
    return jnp.where(take, bv, av), jnp.where(take, bi, ai)


def moe_router(logits):
    """Switch-style top-1 routing of tokens over experts (last axis), in float32: each token's top
    expert and its top logit in one variadic reduce, the softmax shifted by that logit, the gate
    (the top expert's probability) and the load-balancing loss (experts times the sum over experts
    of the fraction of tokens routed to each and its mean probability). Returns (gate in the
    logits' dtype, expert, loss)."""
    x = logits.astype(F32)
    n_experts = x.shape[-1]
    idx = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    top, expert = jax.lax.reduce((x, idx), (jnp.float32(-jnp.inf), jnp.int32(0)), top1_pair, (x.ndim - 1,))
    e = jnp.exp(x - top[..., None])
    total = jnp.sum(e, axis=-1)
    probs = e / total[..., None]
    routed = jnp.mean(jax.nn.one_hot(expert, n_experts, dtype=F32), axis=tuple(range(x.ndim - 1)))
    mean_probs = jnp.mean(probs, axis=tuple(range(x.ndim - 1)))
    loss = n_experts * jnp.sum(routed * mean_probs)
    return (1.0 / total).astype(logits.dtype), expert, loss


def cross_entropy(logits, labels):
    """Mean softmax cross-entropy over a `VOCAB`-wide last axis (one_hot, not a gather)."""
    logp = jax.nn.log_softmax(logits.astype(F32), axis=-1)
    onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=F32)
    return jnp.mean(-jnp.sum(onehot * logp, axis=-1))


def bias_gelu_dropout(x, bias, key, rate=DROPOUT_RATE):
    """dropout(gelu(x + bias)) with an exact (erf) GELU; `key` is a raw uint32[2] PRNG key."""
    h = jax.nn.gelu(x + bias, approximate=False)
    keep = jax.random.bernoulli(key, 1.0 - rate, h.shape)
    return jnp.where(keep, h / (1.0 - rate), 0).astype(x.dtype)


def gelu_layernorm(x, bias, gamma, beta):
    """A BERT prediction head's transform after its matrix product: the exact (erfc) GELU, as
    Hugging Face's BERT has it, then a layernorm. XLA runs it as one Triton kernel whose erfc does
    not hide under the loads (the target's calibration.xla_triton_slow_ns)."""
    h = jax.nn.gelu((x + bias).astype(F32), approximate=False)
    return layernorm(h, gamma, beta).astype(x.dtype)


def bias_gelu_bwd(x, bias, dy):
    """Backward of gelu(x + bias) (exact erf GELU): dx and the bias gradient, a column reduction
    over every row."""
    _, vjp = jax.vjp(lambda x, b: jax.nn.gelu(x + b, approximate=False), x, bias)
    return vjp(dy)


def fig7_chain(x, w):
    """AStitch Fig. 7-like chain: a reduction and an expensive elementwise op both feed broadcasts."""
    c = x.shape[-1]
    a = jnp.tanh(x.astype(F32)) * w.astype(F32)
    s = jnp.sum(a, axis=-1)
    t = jnp.exp(-s / c)  # expensive elementwise op on the reduced value, feeding a broadcast
    y = a * t[:, None]
    m = jnp.max(y, axis=-1)
    return (y - m[:, None]).astype(x.dtype)


# ----------------------------------------------------------------------------------------------------
# Forward + backward wrappers (the benchmarked functions)
# ----------------------------------------------------------------------------------------------------

def layernorm_fwdbwd(x, gamma, beta, dy):
    y, vjp = jax.vjp(layernorm, x, gamma, beta)
    dx, dgamma, dbeta = vjp(dy)
    return y, dx, dgamma, dbeta


def rmsnorm_residual_fwdbwd(x, residual, w, dy, dh):
    (y, h), vjp = jax.vjp(residual_rmsnorm, x, residual, w)
    dx, dresidual, dw = vjp((dy, dh))
    return y, h, dx, dresidual, dw


def softmax_fwdbwd(x, dy):
    y, vjp = jax.vjp(softmax, x)
    (dx,) = vjp(dy)
    return y, dx


def rmsnorm_rope_fwdbwd(x, w, cos, sin, dy):
    out, vjp = jax.vjp(lambda x, w: rmsnorm_rope(x, w, cos, sin), x, w)
    dx, dw = vjp(dy)
    return out, dx, dw


def causal_softmax_bwd(probs, dprobs, head_dim=64):
    """Causal attention's softmax backward from the saved probabilities ([batch x heads, q, k]):
    `p * (dp - sum(dp * p))`, masked again and scaled by 1/sqrt(head_dim), as a GPT's attention
    gradient runs it between its two matrix products. XLA runs it as two kernels: its reduction
    does not fuse with the ops reading the sum back (plan/diamonds.py). Returns probs.dtype."""
    s = probs.shape[-1]
    causal = jnp.tril(jnp.ones((s, s), bool))
    p, dp = probs.astype(F32), dprobs.astype(F32)
    ds = p * (dp - jnp.sum(dp * p, axis=-1, keepdims=True))
    return (jnp.where(causal, ds, 0.0) / jnp.sqrt(jnp.float32(head_dim))).astype(probs.dtype)


def xent_fwdbwd(logits, labels):
    loss, dlogits = jax.value_and_grad(cross_entropy)(logits, labels)
    return loss, dlogits


def label_cross_entropy(logits, labels):
    """Mean cross-entropy with each row's label logit picked by take_along_axis, as optax's
    `softmax_cross_entropy_with_integer_labels` computes it (GPT's loss): its gradient scatters one
    value per row into zeros of the logits' shape (row_scatter.py)."""
    lf = logits.astype(F32)
    picked = jnp.take_along_axis(lf, labels[:, None], axis=-1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(lf, axis=-1) - picked)


def xent_labels_fwdbwd(logits, labels):
    return jax.value_and_grad(label_cross_entropy)(logits, labels)


# ----------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------

def _normal(key, shape, dtype, scale=1.0, mean=0.0):
    return (mean + scale * jax.random.normal(key, shape, F32)).astype(dtype)


def dien_attention(keys, query, mask):
    """DIEN's attention over a user's behaviour sequence, with its small dims ([B, 50, 36]): scores
    q.k over the 36 features, masked to the sequence length, softmax over the 50 steps, and the
    weighted sum of the steps. Statistics in float32; returns keys.dtype."""
    k, q = keys.astype(F32), query.astype(F32)
    scores = jnp.sum(q[:, None, :] * k, axis=-1) / jnp.sqrt(jnp.float32(k.shape[-1]))
    p = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    return jnp.sum(p[..., None] * k, axis=1).astype(keys.dtype)


def dien_attention_fwdbwd(keys, query, mask, dout):
    """The attention above and its gradients with respect to the keys and the query."""
    out, vjp = jax.vjp(lambda k, q: dien_attention(k, q, mask), keys, query)
    return (out,) + vjp(dout)


def dien_gru(kernel, h0, gx, mask, reverse=False):
    """DIEN's interest-extractor GRU over time (`lax.scan`): the input projection gx [T, B, 3H] is
    made outside, the body holds the recurrent product h @ kernel and the gates; masked steps
    ([T, B, 1], bool) keep the state. Every step is a few microseconds of work on narrow tensors,
    so XLA's loop of launches bounds it, not memory (plan/scan.py)."""
    def step(h, inputs):
        g, valid = inputs
        gr, gz, gn = jnp.split(g, 3, axis=-1)
        hr, hz, hn = jnp.split(h @ kernel, 3, axis=-1)
        r = jax.nn.sigmoid(gr + hr)
        z = jax.nn.sigmoid(gz + hz)
        n = jnp.tanh(gn + r * hn)
        h = jnp.where(valid, (1 - z) * h + z * n, h)
        return h, h
    return jax.lax.scan(step, h0, (gx, mask), reverse=reverse)[1]


def dien_gru_fwdbwd(kernel, h0, gx, mask, dstates):
    """The GRU and its gradients: a forward scan saving residuals, then a reverse scan whose carry
    sums the recurrent weight's gradient over rows and steps."""
    states, vjp = jax.vjp(lambda k, h, g: dien_gru(k, h, g, mask), kernel, h0, gx)
    return (states,) + vjp(dstates)


ADAM_B1, ADAM_B2, ADAM_EPS, ADAM_LR, WEIGHT_DECAY = 0.9, 0.999, 1e-8, 1e-4, 0.01


def adamw_update(params, grads, mu, nu, count):
    """One AdamW step over a list of parameters (optax.adamw's arithmetic, written out so that the
    suite needs no optax): moments in float32, parameters back in their own dtype. Every tensor's
    update is independent of the others: a case for stitching independent regions into one launch."""
    bc1, bc2 = 1 - ADAM_B1 ** count, 1 - ADAM_B2 ** count

    def one(p, g, m, v):
        g32, p32 = g.astype(F32), p.astype(F32)
        m = ADAM_B1 * m + (1 - ADAM_B1) * g32
        v = ADAM_B2 * v + (1 - ADAM_B2) * g32 * g32
        step = (m / bc1) / (jnp.sqrt(v / bc2) + ADAM_EPS) + WEIGHT_DECAY * p32
        return (p32 - ADAM_LR * step).astype(p.dtype), m, v

    out = [one(*t) for t in zip(params, grads, mu, nu)]
    return [o[0] for o in out], [o[1] for o in out], [o[2] for o in out]


def bert_param_shapes(layers: int, hidden: int, vocab: int, max_pos: int = 512) -> list[tuple[int, ...]]:
    """The parameter shapes of a BERT encoder (BERT-base: 12 layers, hidden 768, vocab 30522: 199
    tensors, 110M values)."""
    h, f = hidden, 4 * hidden
    shapes = [(vocab, h), (max_pos, h), (2, h), (h,), (h,)]  # embeddings and their layer norm
    for _ in range(layers):
        shapes += [(h, h), (h,)] * 4          # query, key, value, attention output
        shapes += [(h,), (h,)]                # attention layer norm
        shapes += [(h, f), (f,), (f, h), (h,)]  # feed-forward
        shapes += [(h,), (h,)]                # output layer norm
    return shapes + [(h, h), (h,)]            # pooler


def _raw_key(key):
    """A legacy uint32[2] key drawn from `key` (typed or raw)."""
    k = jax.random.fold_in(key, 0x5eed)
    return jax.random.key_data(k) if jnp.issubdtype(k.dtype, jax.dtypes.prng_key) else k


def _layernorm_inputs(key, dtype, n, h, with_dy=False):
    kx, kg, kb, kd = jax.random.split(key, 4)
    args = (_normal(kx, (n, h), dtype), _normal(kg, (h,), dtype, 0.1, 1.0),
            _normal(kb, (h,), dtype, 0.1))
    return args + ((_normal(kd, (n, h), dtype),) if with_dy else ())


def _rmsnorm_residual_inputs(key, dtype, n, h):
    kx, kr, kw, kd, kh = jax.random.split(key, 5)
    return (_normal(kx, (n, h), dtype), _normal(kr, (n, h), dtype),
            _normal(kw, (h,), dtype, 0.1, 1.0), _normal(kd, (n, h), dtype),
            _normal(kh, (n, h), dtype))


def _rmsnorm_rope_inputs(key, dtype, n, h):
    """Token positions 0..n-1 (rotary angles in float32, as models keep them), hidden h = heads x
    HEAD_DIM."""
    kx, kw, kd = jax.random.split(key, 3)
    half = HEAD_DIM // 2
    freq = 10000.0 ** (-jnp.arange(half, dtype=F32) / half)
    angle = jnp.arange(n, dtype=F32)[:, None] * freq
    return (_normal(kx, (n, h), dtype), _normal(kw, (h,), dtype, 0.1, 1.0), jnp.cos(angle), jnp.sin(angle),
            _normal(kd, (n, h // HEAD_DIM, HEAD_DIM), dtype))


def _rmsnorm_rope_fwd_inputs(key, dtype, n, h):
    return _rmsnorm_rope_inputs(key, dtype, n, h)[:4]


def _rows_inputs(key, dtype, n, c, count=1):
    """`count` independent standard-normal [N,C] arrays (softmax x, dy, ...)."""
    return tuple(_normal(k, (n, c), dtype) for k in jax.random.split(key, count))


def _causal_probs_inputs(key, dtype, bh, q, k):
    """Softmax probabilities of random scores ([bh, q, k], q == k) and their gradient. Unmasked, so
    no input is zero and the mask has entries above the diagonal to clear."""
    if q != k:
        raise ValueError(f"attention_softmax_bwd: a causal mask is square, got q={q}, k={k}")
    ks, kd = jax.random.split(key)
    probs = jax.nn.softmax(_normal(ks, (bh, q, k), F32, 2.0), axis=-1)
    return probs.astype(dtype), _normal(kd, (bh, q, k), dtype)


def _sorted_logits_inputs(key, dtype, n, v):
    """Logits sorted in descending order along each row, as a sampler hands them to the filter."""
    return (-jnp.sort(-_normal(key, (n, v), F32, 2.0), axis=-1).astype(dtype),)


def _xent_inputs(key, dtype, n, v):
    kl, ky = jax.random.split(key)
    return _normal(kl, (n, v), dtype, 2.0), jax.random.randint(ky, (n,), 0, v, jnp.int32)


def _bias_gelu_dropout_inputs(key, dtype, n, h):
    kx, kb = jax.random.split(key)
    return _normal(kx, (n, h), dtype), _normal(kb, (h,), dtype, 0.1), _raw_key(key)


def _gelu_layernorm_inputs(key, dtype, n, h):
    kx, kb = jax.random.split(key)
    return (_normal(kx, (n, h), dtype), _normal(kb, (h,), dtype, 0.1)) + _layernorm_inputs(key, dtype, 1, h)[1:]


def _bias_gelu_bwd_inputs(key, dtype, n, c):
    kx, kb, kd = jax.random.split(key, 3)
    return _normal(kx, (n, c), dtype), _normal(kb, (c,), dtype, 0.1), _normal(kd, (n, c), dtype)


def _fig7_inputs(key, dtype, n, c):
    kx, kw = jax.random.split(key)
    return _normal(kx, (n, c), dtype), _normal(kw, (c,), dtype, 0.5, 1.0)


def _dien_inputs(key, dtype, b, t, d):
    kk, kq, kl, kd = jax.random.split(key, 4)
    lengths = jax.random.randint(kl, (b, 1), 1, t + 1)  # every sequence has at least one step
    mask = jnp.arange(t)[None, :] < lengths
    return _normal(kk, (b, t, d), dtype), _normal(kq, (b, d), dtype), mask, _normal(kd, (b, d), dtype)


def _gru_inputs(key, dtype, b, t, h):
    kw, kh, kg, kl, kd = jax.random.split(key, 5)
    lengths = jax.random.randint(kl, (1, b, 1), 1, t + 1)
    mask = jnp.arange(t)[:, None, None] < lengths
    return (_normal(kw, (h, 3 * h), dtype, 0.3), _normal(kh, (b, h), dtype), _normal(kg, (t, b, 3 * h), dtype),
            mask, _normal(kd, (t, b, h), dtype))


def _adamw_inputs(key, dtype, layers, hidden, vocab):
    shapes = bert_param_shapes(layers, hidden, vocab)
    keys = jax.random.split(key, 4 * len(shapes)).reshape(4, len(shapes))
    params = [_normal(k, s, dtype, 0.02) for k, s in zip(keys[0], shapes)]
    grads = [_normal(k, s, dtype, 1e-3) for k, s in zip(keys[1], shapes)]
    mu = [_normal(k, s, F32, 1e-4) for k, s in zip(keys[2], shapes)]
    nu = [jnp.abs(_normal(k, s, F32, 1e-6)) for k, s in zip(keys[3], shapes)]
    return params, grads, mu, nu, jnp.float32(10.0)


# ----------------------------------------------------------------------------------------------------
# The suite
# ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Workload:
    """A benchmark case. `full_shape` / `quick_shape` are the main [rows, cols] array's shape (the
    attentions' [batch, steps, features] and [batch x heads, q, k]; the GRU's batch, steps and
    hidden size; the optimizer's model size);
    `draw(key, dtype, *shape)` draws the inputs for any such shape."""
    name: str
    fn: Callable
    draw: Callable
    full_shape: tuple
    quick_shape: tuple

    def shape(self, quick: bool) -> tuple:
        return self.quick_shape if quick else self.full_shape

    def make_inputs(self, key, dtype, quick: bool) -> tuple:
        return self.draw(key, dtype, *self.shape(quick))


def _workload(name, fn, draw, full_shape, quick_shape):
    return Workload(name, fn, draw, full_shape, quick_shape)


_SUITE = (
    _workload("layernorm_fwd", layernorm, _layernorm_inputs, (32768, 1024), (2048, 1024)),
    _workload("layernorm_fwdbwd", layernorm_fwdbwd, partial(_layernorm_inputs, with_dy=True),
              (32768, 1024), (2048, 1024)),
    _workload("rmsnorm_residual_fwdbwd", rmsnorm_residual_fwdbwd, _rmsnorm_residual_inputs,
              (32768, 1024), (2048, 1024)),
    _workload("softmax_fwd", softmax, _rows_inputs, (16384, 4096), (1024, 1024)),
    _workload("softmax_fwdbwd", softmax_fwdbwd, partial(_rows_inputs, count=2),
              (16384, 4096), (1024, 1024)),
    _workload("xent_fwdbwd", xent_fwdbwd, _xent_inputs, (4096, VOCAB), (256, VOCAB)),
    _workload("xent_labels_fwdbwd", xent_labels_fwdbwd, _xent_inputs, (4096, VOCAB), (256, VOCAB)),
    _workload("token_logprob", token_logprob, _xent_inputs, (4096, VOCAB), (256, VOCAB)),
    _workload("bias_gelu_dropout", bias_gelu_dropout, _bias_gelu_dropout_inputs,
              (16384, 4096), (1024, 1024)),
    _workload("fig7_chain", fig7_chain, _fig7_inputs, (32768, 2048), (1024, 1024)),
    # BERT-large's head transform over 32 x 512 tokens.
    _workload("gelu_layernorm", gelu_layernorm, _gelu_layernorm_inputs, (16384, 1024), (2048, 1024)),
    # Irregular shapes (AStitch's thread-mapping cases): a few very long rows, very many short rows,
    # column reductions over many rows with 1k and with 16 columns.
    _workload("softmax_fwdbwd_long", softmax_fwdbwd, partial(_rows_inputs, count=2),
              (32, 262144), (4, 16384)),
    _workload("softmax_fwdbwd_short", softmax_fwdbwd, partial(_rows_inputs, count=2),
              (524288, 64), (4096, 64)),
    _workload("layernorm_fwdbwd_short", layernorm_fwdbwd, partial(_layernorm_inputs, with_dy=True),
              (262144, 64), (4096, 64)),
    _workload("bias_gelu_bwd", bias_gelu_bwd, _bias_gelu_bwd_inputs, (16384, 1024), (1024, 1024)),
    _workload("bias_gelu_bwd_narrow", bias_gelu_bwd, _bias_gelu_bwd_inputs, (1 << 20, 16), (16384, 16)),
    # DIEN's attention ([batch, 50 steps, 36 features]); AdamW over BERT-base's 199 parameter tensors
    # (shape: layers, hidden, vocab).
    _workload("dien_attention_fwdbwd", dien_attention_fwdbwd, _dien_inputs, (16384, 50, 36), (512, 50, 36)),
    _workload("adamw_bert", adamw_update, _adamw_inputs, (12, 768, 30522), (2, 64, 1000)),
    # Data-moving ops inside a region: a rotary embedding's slices and concatenate after an RMS norm
    # (its gradient pads), [tokens, heads x 128].
    _workload("rmsnorm_rope_fwd", rmsnorm_rope, _rmsnorm_rope_fwd_inputs, (16384, 2048), (512, 1024)),
    _workload("rmsnorm_rope_fwdbwd", rmsnorm_rope_fwdbwd, _rmsnorm_rope_inputs, (16384, 2048), (512, 1024)),
    # Scans along rows: nucleus sampling's filter over a 32k vocabulary (softmax, cumsum, mask,
    # renormalize); a survival curve over 512 steps and its gradient (a cumsum, then a reverse one).
    _workload("top_p_filter", top_p_filter, _sorted_logits_inputs, (2048, VOCAB), (64, 4096)),
    _workload("survival_fwdbwd", survival_fwdbwd, partial(_rows_inputs, count=2), (65536, 512), (2048, 512)),
    # A variadic reduce: mixture-of-experts top-1 routing of 1M tokens over 64 experts (the top
    # expert with its logit, the gate, the load-balancing loss's column means).
    _workload("moe_router", moe_router, _rows_inputs, (1 << 20, 64), (4096, 64)),
    # Attention's softmax backward between its matrix products, GPT-2-small-like (8 sequences x 12
    # heads of 512 tokens): the one part of attention's gradient a reduction ends XLA's kernel in.
    _workload("attention_softmax_bwd", causal_softmax_bwd, _causal_probs_inputs, (96, 512, 512),
              (12, 128, 128)),
    _workload("dien_gru_fwdbwd", dien_gru_fwdbwd, _gru_inputs, (256, 50, 36), (64, 20, 36)),
)

WORKLOADS: dict[str, Workload] = {w.name: w for w in _SUITE}


def workload_names() -> list[str]:
    return list(WORKLOADS)
