"""How far an attention block's bfloat16 gradients are from float32, under jax.jit and jaxstitch.jit
with JAXSTITCH_TUNE specs, in one process (session 45's check of cuda_ops.written_half):

    python3 scripts/rounding_probe.py [--seeds 6] [--tune wide_converts=1 ...]

Prints, per seed, each output's largest distance from the function run on float32 inputs (float32
matrix products on both sides): dx, dw, db (the key bias's part of db is exactly 0)."""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxstitch  # noqa: E402
from strategies import random_inputs  # noqa: E402
from test_batched_products import bias_attention_grads, bias_specs  # noqa: E402


def distance(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--tune", nargs="*", default=[])
    args = p.parse_args()
    specs = bias_specs(jnp.bfloat16, 3, 72, 3 * 40)
    for seed in range(1, args.seeds + 1):
        inputs = random_inputs(specs, seed)
        with jax.default_matmul_precision("float32"):
            exact = jax.tree.leaves(jax.jit(bias_attention_grads)(*[a.astype(jnp.float32) for a in inputs]))
            runs = [("jax.jit", jax.tree.leaves(jax.jit(bias_attention_grads)(*inputs)))]
            for spec in [""] + args.tune:
                os.environ["JAXSTITCH_TUNE"] = spec
                runs.append((f"jaxstitch {spec}".strip(), jax.tree.leaves(jaxstitch.jit(bias_attention_grads)(*inputs))))
            os.environ["JAXSTITCH_TUNE"] = ""
        print(seed, " | ".join(f"{name} " + ",".join(f"{distance(o, e):.3g}" for o, e in zip(outs, exact))
                               for name, outs in runs), flush=True)


if __name__ == "__main__":
    main()
