"""How far bfloat16 results are from float32, under jax.jit and jaxstitch.jit with JAXSTITCH_TUNE
specs, in one process (it checked cuda_ops.written_half and the scans' unrounded carry):

    python3 scripts/rounding_probe.py [--case attention|gru] [--seeds 6] [--tune wide_converts=1 ...]

Prints, per seed, each output's largest distance from the function run on float32 inputs (float32
matrix products on both sides). `attention`: an attention block's gradients dx, dw, db (the key
bias's part of db is exactly 0); `gru`: DIEN's GRU over 50 steps forward and backward (a scan),
then also jaxstitch's largest distance from jax.jit's results."""
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
from jaxstitch.bench.workloads import WORKLOADS  # noqa: E402


def case(name: str, seed: int):
    """(function, bfloat16 inputs) of a case on fresh inputs."""
    if name == "gru":
        gru = WORKLOADS["dien_gru_fwdbwd"]
        return gru.fn, gru.draw(jax.random.key(seed), jnp.bfloat16, *gru.shape(False))
    return bias_attention_grads, random_inputs(bias_specs(jnp.bfloat16, 3, 72, 3 * 40), seed)


def distance(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--tune", nargs="*", default=[])
    p.add_argument("--case", choices=["attention", "gru"], default="attention")
    args = p.parse_args()
    for seed in range(1, args.seeds + 1):
        fn, inputs = case(args.case, seed)
        wide = [a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in inputs]
        with jax.default_matmul_precision("float32"):
            exact = jax.tree.leaves(jax.jit(fn)(*wide))
            runs = [("jax.jit", jax.tree.leaves(jax.jit(fn)(*inputs)))]
            for spec in [""] + args.tune:
                os.environ["JAXSTITCH_TUNE"] = spec
                runs.append((f"jaxstitch {spec}".strip(), jax.tree.leaves(jaxstitch.jit(fn)(*inputs))))
            os.environ["JAXSTITCH_TUNE"] = ""
        line = " | ".join(f"{name} " + ",".join(f"{distance(o, e):.3g}" for o, e in zip(outs, exact))
                          for name, outs in runs)
        if args.case == "gru":
            line += " | ours-jax.jit " + ",".join(f"{distance(o, x):.3g}" for o, x in zip(runs[1][1], runs[0][1]))
        print(seed, line, flush=True)


if __name__ == "__main__":
    main()
