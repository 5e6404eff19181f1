"""XLA's optimized HLO of a train step, jax.jit and jaxstitch.jit, gzipped to a folder ($OUT, else
/tmp), with each program's kernel counts: to read what XLA does around our custom calls (the
transposes and matrix-product layouts it picks next to them), which only a GPU compile shows.
`--devices N` splits the batch over N GPUs as examples/dp_train.py does (state replicated): what each
GPU runs, to set against `--devices 1` (a 2-layer BERT step on 2 H200s showed its split bias
gradients' epilogues as kernels of their own after the all-reduce).

    python3 scripts/dump_step_hlo.py [--model bert|gpt|dien] [--dtype bfloat16] [--devices 2]
"""
import argparse
import gzip
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "examples")]
from example_models import load_example, model_arguments  # noqa: E402

import jax  # noqa: E402

import dp_train  # noqa: E402
import train_harness  # noqa: E402


def main():
    p = model_arguments(argparse.ArgumentParser())
    p.add_argument("--devices", type=int, default=1, help="GPUs to split the batch over")
    args = p.parse_args()
    example, init, batch = load_example(args)
    out = os.environ.get("OUT", "/tmp")
    place = dp_train.placer(jax.devices()[:args.devices])
    for name, jit in (("jit", jax.jit), ("stitch", train_harness.UNGUARDED)):
        graphdef, state = init()
        flat, leaves = train_harness.over_leaves(example.train_step, graphdef, place(state, "state"))
        text = jit(flat, donate_argnums=(0,)).lower(leaves, place(batch(0), "batch")).compile().as_text()
        path = os.path.join(out, f"{args.model}_{args.devices}gpu_{name}.hlo.txt.gz")
        with gzip.open(path, "wt") as fh:
            fh.write(text)
        kernels, memory = train_harness.kernel_counts(text)
        print(f"{path}: {len(text)} characters, {kernels} kernels, {memory} memory-bound", flush=True)


if __name__ == "__main__":
    main()
