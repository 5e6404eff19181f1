"""The fingerprint of every kernel source the planner and codegen write for a fixed set of programs:
a refactor of planning or codegen that should change nothing must leave it byte-identical.

    python3 scripts/kernel_fingerprint.py [--quick] [--target h200] [--list FILE]

Programs (planned with `explain`, CPU-only is fine): every benchmark workload in float32 and
bfloat16 at its full shape (quick shape with --quick), the BERT, GPT and DIEN train steps in
bfloat16 (their QUICK sizes with --quick), and the zoo's train steps in bfloat16 (QUICK sizes
with --quick). Prints the number of sources, distinct sources and the sha256 over the sorted
distinct sources' hashes; `--list` writes one "program sha256" line per source (diff two lists to
find what moved).
"""
import argparse
import dataclasses
import hashlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "examples"), HERE]
os.environ.setdefault("JAXSTITCH_PROGRESS", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxstitch  # noqa: E402
from jaxstitch.lowering import codegen  # noqa: E402
from jaxstitch.bench.workloads import WORKLOADS  # noqa: E402

EXAMPLES = ("bert_train", "gpt_train", "dien_train")


def programs(quick: bool):
    """(name, function, abstract arguments) of each program fingerprinted."""
    for name, w in WORKLOADS.items():
        for dtype in (jnp.float32, jnp.bfloat16):
            shape = w.shape(quick)
            args = jax.eval_shape(lambda w=w, d=dtype, s=shape: tuple(w.draw(jax.random.key(0), d, *s)))
            yield f"{name}/{jnp.dtype(dtype).name}", w.fn, args
    import importlib

    import zoo

    for name in EXAMPLES:
        module = importlib.import_module(name)
        c = module.QUICK if quick else module.Config()
        if "dtype" in {f.name for f in dataclasses.fields(c)} and name != "dien_train":
            c = dataclasses.replace(c, dtype="bfloat16")
        graphdef, state = module.make_init(c, 0)()
        yield name, module.train_step, (graphdef, state, module.make_batches(c, 0)(0))
    for name, m in zoo.MODELS.items():
        if m.inference:
            continue
        c = m.quick(dtype="bfloat16") if quick else m.config(dtype="bfloat16")
        graphdef, state = m.make_init(c, 0)()
        yield f"zoo/{name}", m.step, (graphdef, state, jax.jit(m.make_batches(c, 0))(0))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--target", default="h200")
    p.add_argument("--list", default=None, help="write 'program sha256' for every source here")
    args = p.parse_args()
    seen: list[tuple[str, str]] = []
    current = [""]
    render = codegen.render

    def recording(plan):
        source = render(plan)
        seen.append((current[0], hashlib.sha256(source.code.encode()).hexdigest()))
        return source

    codegen.render = recording
    for name, fn, fn_args in programs(args.quick):
        current[0] = name
        jaxstitch.explain(fn, *fn_args, target=args.target)
        print(f"  {name}: {sum(1 for n, _ in seen if n == name)} sources", flush=True)
    distinct = sorted({h for _, h in seen})
    print(f"{len(seen)} sources, {len(distinct)} distinct, fingerprint "
          f"{hashlib.sha256(''.join(distinct).encode()).hexdigest()}")
    if args.list:
        with open(args.list, "w") as f:
            f.writelines(f"{n} {h}\n" for n, h in seen)


if __name__ == "__main__":
    main()
