"""XLA's optimized HLO of a train step, jax.jit and jaxstitch.jit, gzipped to a folder ($OUT, else
/tmp): to read what XLA does around our custom calls (the transposes and matrix-product layouts it
picks next to them), which only a GPU compile shows.

    python3 scripts/dump_step_hlo.py [--model bert|gpt|dien] [--dtype bfloat16]
"""
import argparse
import gzip
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "examples")]
from profile_step import load_example, model_arguments  # noqa: E402  (first: torch's CUDA context)

import jax  # noqa: E402

import jaxstitch  # noqa: E402


def main():
    args = model_arguments(argparse.ArgumentParser()).parse_args()
    example, init, batch = load_example(args)
    out = os.environ.get("OUT", "/tmp")
    for name, jit in (("jit", jax.jit), ("stitch", jaxstitch.jit)):
        graphdef, state = init()
        f = jit(example.train_step, static_argnums=(0,), donate_argnums=(1,))
        text = f.lower(graphdef, state, batch(0)).compile().as_text()
        path = os.path.join(out, f"{args.model}_{name}.hlo.txt.gz")
        with gzip.open(path, "wt") as fh:
            fh.write(text)
        print(path, len(text), flush=True)


if __name__ == "__main__":
    main()
