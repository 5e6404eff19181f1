"""GPT's causal attention (examples/gpt_train.py's form) forward and backward, one layer, timed by
the wall clock in one process: jax.jit and jaxstitch.jit of the program as written, and jax.jit of
`jax.nn.dot_product_attention(implementation="cudnn")` (flash attention, which never writes the
scores), with each one's largest relative difference from jax.jit's results.

    python3 scripts/attention_probe.py          # [8, 512, 12, 64] bfloat16, on a GPU machine
    SMALL=1 python3 scripts/attention_probe.py  # a tiny shape (cuDNN's variant fails without a GPU)
"""
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxstitch

B, S, H, D = (8, 512, 12, 64) if not os.environ.get("SMALL") else (1, 64, 2, 64)
dt = jnp.bfloat16

def attn_ref(q, k, v):
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(D).astype(dt)
    causal = jnp.tril(jnp.ones((S, S), bool))
    scores = jnp.where(causal, scores.astype(jnp.float32), -1e9)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)

def attn_cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, scale=1.0 / np.sqrt(D), is_causal=True,
                                        implementation="cudnn")

def fwdbwd(f):
    def g(q, k, v, do):
        o, vjp = jax.vjp(f, q, k, v)
        return (o,) + vjp(do)
    return g

keys = jax.random.split(jax.random.key(0), 4)
q, k, v, do = (jax.random.normal(kk, (B, S, H, D), jnp.float32).astype(dt) for kk in keys)
variants = {"jax.jit": jax.jit(fwdbwd(attn_ref)), "jaxstitch": jaxstitch.jit(fwdbwd(attn_ref)),
            "cudnn": jax.jit(fwdbwd(attn_cudnn))}
outs = {}
for name, f in variants.items():
    try:
        outs[name] = jax.block_until_ready(f(q, k, v, do))
    except Exception as e:
        print(name, "failed:", type(e).__name__, str(e)[:300]); continue
ref = outs["jax.jit"]
for name, o in outs.items():
    f32 = lambda x: np.asarray(x.astype(jnp.float32))
    errs = [np.max(np.abs(f32(a) - f32(b))) / np.max(np.abs(f32(b))) for a, b in zip(o, ref)]
    print(name, "max rel err vs jax.jit", ["%.2e" % e for e in errs])
times = {n: [] for n in outs}
for r in range(7):
    for name in outs:
        f = variants[name]
        jax.block_until_ready(f(q, k, v, do))
        t = time.perf_counter()
        for _ in range(50):
            o = f(q, k, v, do)
        jax.block_until_ready(o)
        times[name].append((time.perf_counter() - t) / 50 * 1e6)
for n, ts in times.items():
    print(f"{n:10s} median {np.median(ts):8.1f} us  (x{np.median(times['jax.jit'])/np.median(ts):.2f} vs jax.jit)")
print(jaxstitch.explain(fwdbwd(attn_ref), q, k, v, do, target="h100"))
