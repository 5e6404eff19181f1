"""Compile time under jax.jit and jaxstitch.jit: train steps, and a served model's new shapes.

    python3 scripts/compile_time.py [--only bert gpt resnet ...] [--dtype bfloat16] [--json PATH]
    python3 scripts/compile_time.py --serve [--shapes 1x16 8x128 ...]
    python3 scripts/compile_time.py --only dlrm --quick --target h100   # CPU dry run

Every measurement runs in a fresh process of its own. In one process the second compiler would find
the first one's matrix-product autotuning in XLA's in-process cache, which is much of a train step's
compile: the comparison would favour whichever went second.

Train steps (the examples' BERT, GPT and DIEN, and the zoo's models), `.lower(...).compile()` with
the state donated as in training, no step run:
  * jax.jit: lower (trace) and compile seconds, and XLA's backend compile by jax's own event;
  * jaxstitch.jit cold (an empty kernel cache) and warm (a new process on the cache the cold one
    filled): lower (our build and the rebuilt program's lowering), compile (XLA's compile of the
    rebuilt program), and the build by stage (driver/build_times.py) with NVRTC's compiles.

Serving (`--serve`, examples/serve.py's encoder, bfloat16 weights as it has them): jax.jit traces and
compiles at each new shape; jaxstitch exports once with symbolic batch and sequence, and a new shape
costs `jax.jit(exported.call)`'s lower and compile. Each shape's first-call seconds, both ways, each
compiler in its own process; the export itself (warm cache) reported apart.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "examples"), HERE]
sys.path.append(os.path.join(HERE, ".."))  # (jaxstitch from this checkout where it is not installed)
EXAMPLES = ("bert", "gpt", "dien")
SHAPES = ("1x16", "3x77", "8x128", "16x200", "32x384", "64x512")


# ----------------------------------------------------------------------------------------------------
# The child process: one compiler, one model
# ----------------------------------------------------------------------------------------------------

def _warm_backend():
    """The backend's one-time start (CUDA context, the first tiny compile), paid before any timing."""
    import jax
    import jax.numpy as jnp
    jax.block_until_ready(jax.jit(lambda x: x + 1)(jnp.ones(8)))


def _train_step(name: str, dtype: str, quick: bool):
    """(step, state, batch, whether the step donates its state) for an example's or the zoo's model:
    a train step over its state's leaves (as the examples run it), an inference step as it is."""
    import dataclasses
    import importlib

    import train_harness
    if name in EXAMPLES:
        ex = importlib.import_module(f"{name}_train")
        c = ex.QUICK if quick and hasattr(ex, "QUICK") else ex.Config()
        if hasattr(c, "dtype"):
            c = dataclasses.replace(c, dtype=dtype)
        init, batches, step = ex.make_init(c, 0), ex.make_batches(c, 0), ex.train_step
    else:
        from zoo import MODELS
        model = MODELS[name]
        c = (model.quick if quick else model.config)(dtype=dtype)
        init, batches, step = model.make_init(c, 0), model.make_batches(c, 0), model.step
    graphdef, state = init()
    if name not in EXAMPLES and MODELS[name].inference:
        import functools
        return functools.partial(step, graphdef), state, batches(0), False
    flat, leaves = train_harness.over_leaves(step, graphdef, state)
    return flat, leaves, batches(0), True


def child_train(name: str, compiler: str, dtype: str, quick: bool, target: str | None) -> dict:
    import jax

    import jaxstitch
    from jaxstitch.integration.xla_compiles import xla_compiling
    _warm_backend()
    step, state, batch, donate = _train_step(name, dtype, quick)
    opts = {"donate_argnums": (0,)} if donate else {}
    f = jax.jit(step, **opts) if compiler == "jax.jit" else jaxstitch.jit(step, guard=False, target=target, **opts)
    before = jaxstitch.cache_stats()
    with xla_compiling() as seen:  # (XLA's backend compiles in this thread, by jax's own event)
        t0 = time.perf_counter()
        lowered = f.lower(state, batch)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
    after = jaxstitch.cache_stats()
    out = {"lower_s": t1 - t0, "compile_s": t2 - t1, "xla_s": sum(s for _, s in seen)}
    record = [r for r in jaxstitch.xla_compiles() if r.build is not None]
    if compiler != "jax.jit" and record:
        b = record[-1].build
        out["build"] = {k: getattr(b, k) for k in ("total", "trace", "partition", "plan", "nvrtc", "bodies",
                                                   "nvrtc_busy", "nvrtc_cpu")}
        out["build"]["other"] = b.other
    out["nvrtc_compiles"] = after.nvrtc_compiles - before.nvrtc_compiles
    return out


def child_serve(compiler: str, shapes: list[str], quick: bool, target: str | None) -> dict:
    import jax.numpy as jnp
    import numpy as np
    import serve

    import jaxstitch
    from jaxstitch.integration.xla_compiles import xla_compiling
    _warm_backend()
    c = serve.QUICK if quick else serve.Config()
    state, infer = serve.make_infer(c)
    out: dict = {"shapes": {}}
    if compiler == "jax.jit":
        compile_for = serve.jit_runner(infer)
    else:
        t0 = time.perf_counter()
        platforms = ("cpu",) if target else ("cuda",)  # (a dry run exports for the CPU it runs on)
        _, compile_for = serve.export_runner(infer, state, c, target, platforms)
        out["export_s"] = time.perf_counter() - t0
    before = jaxstitch.cache_stats().nvrtc_compiles
    for shape in shapes:
        b, s = (int(x) for x in shape.split("x"))
        tokens = jnp.asarray(np.random.default_rng(b * 1000 + s).integers(1, c.vocab, (b, s)), jnp.int32)
        with xla_compiling() as seen:
            t0 = time.perf_counter()
            compiled = compile_for(state, tokens)
            if target is None:  # (a GPU: the first result too)
                np.asarray(compiled(state, tokens)[0])
        out["shapes"][shape] = {"first_call_s": time.perf_counter() - t0, "xla_s": sum(x for _, x in seen)}
    out["nvrtc_compiles"] = jaxstitch.cache_stats().nvrtc_compiles - before  # (at the new shapes: none)
    return out


# ----------------------------------------------------------------------------------------------------
# The parent: fresh processes, the table
# ----------------------------------------------------------------------------------------------------

def run_child(argv: list[str], cache_dir: str, timeout: float) -> dict:
    """One measurement in a fresh process; its result is the last line of its output (JSON)."""
    env = dict(os.environ, JAXSTITCH_CACHE_DIR=cache_dir, JAXSTITCH_GUARD="0")
    p = subprocess.run([sys.executable, __file__, "--child", *argv], env=env, capture_output=True, text=True,
                       timeout=timeout)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": (p.stderr or p.stdout).strip().splitlines()[-1:] or [f"rc {p.returncode}"]}
    return json.loads(lines[-1])


def measure_train(name: str, args) -> dict:
    """jax.jit, then jaxstitch cold and warm on one fresh kernel cache, each in its own process."""
    common = ["train", name, "--dtype", args.dtype] + (["--quick"] if args.quick else []) + \
             (["--target", args.target] if args.target else [])
    with tempfile.TemporaryDirectory(prefix="jaxstitch-ct-") as cache:
        return {"jax.jit": run_child(common + ["--compiler", "jax.jit"], cache, args.timeout),
                "cold": run_child(common + ["--compiler", "jaxstitch"], cache, args.timeout),
                "warm": run_child(common + ["--compiler", "jaxstitch"], cache, args.timeout)}


def measure_serve(args) -> dict:
    common = ["serve", "--shapes", *args.shapes] + (["--quick"] if args.quick else []) + \
             (["--target", args.target] if args.target else [])
    with tempfile.TemporaryDirectory(prefix="jaxstitch-ct-") as cache:
        run_child(common + ["--compiler", "jaxstitch"], cache, args.timeout)  # (fills the kernel cache)
        return {"jax.jit": run_child(common + ["--compiler", "jax.jit"], cache, args.timeout),
                "jaxstitch": run_child(common + ["--compiler", "jaxstitch"], cache, args.timeout)}


def train_rows(results: dict) -> list[str]:
    """Markdown rows: a model's compile seconds under each compiler, and where ours went."""
    rows = ["| model | jax.jit s (lower + compile) | jaxstitch warm s | ratio | cold s (NVRTC compiles, "
            "wait s) | our build, warm: stages s | XLA compile s jit / ours |",
            "|---|---:|---:|---:|---:|---|---:|"]
    for name, r in results.items():
        jit, cold, warm = r["jax.jit"], r["cold"], r["warm"]
        if any("error" in x for x in (jit, cold, warm)):
            rows.append(f"| {name} | error: {[x.get('error') for x in (jit, cold, warm)]} |||||")
            continue
        total = {k: v["lower_s"] + v["compile_s"] for k, v in r.items()}
        b = warm.get("build", {})
        stages = ", ".join(f"{k} {b[k]:.1f}" for k in ("trace", "partition", "plan", "nvrtc", "bodies", "other")
                           if b.get(k, 0) >= 0.05)
        rows.append(f"| {name} | {total['jax.jit']:.1f} ({jit['lower_s']:.1f} + {jit['compile_s']:.1f}) | "
                    f"{total['warm']:.1f} | {total['warm'] / total['jax.jit']:.2f}x | {total['cold']:.1f} "
                    f"({cold['nvrtc_compiles']}, {cold.get('build', {}).get('nvrtc', 0):.1f}) | {stages} | "
                    f"{jit['xla_s']:.1f} / {warm['xla_s']:.1f} |")
    return rows


def serve_rows(r: dict) -> list[str]:
    jit, ours = r["jax.jit"], r["jaxstitch"]
    if "error" in jit or "error" in ours:
        return [f"serving: error {jit.get('error')} {ours.get('error')}"]
    rows = [f"export with symbolic batch and sequence, warm kernel cache: {ours['export_s']:.2f} s; "
            f"NVRTC compiles while serving: {ours['nvrtc_compiles']}",
            "| shape | jax.jit first call s | exported jaxstitch first call s | ratio | XLA compile s jit / ours |",
            "|---|---:|---:|---:|---:|"]
    ratios = []
    for shape, j in jit["shapes"].items():
        o = ours["shapes"][shape]
        ratios.append(o["first_call_s"] / j["first_call_s"])
        rows.append(f"| {shape} | {j['first_call_s']:.2f} | {o['first_call_s']:.2f} | {ratios[-1]:.2f}x | "
                    f"{j['xla_s']:.2f} / {o['xla_s']:.2f} |")
    rows.append(f"median ratio {statistics.median(ratios):.2f}x, largest {max(ratios):.2f}x")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("mode", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("name", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--compiler", default="jax.jit", help=argparse.SUPPRESS)
    p.add_argument("--only", nargs="*", default=None, help="models (default: the examples and the zoo's train steps)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--serve", action="store_true", help="the serving model's new shapes instead")
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), help="batch x sequence, e.g. 8x128")
    p.add_argument("--quick", action="store_true", help="the models' tiny configurations")
    p.add_argument("--target", help="plan for this GPU without one (a CPU dry run)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a child may take")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.child:
        out = (child_train(args.name, args.compiler, args.dtype, args.quick, args.target) if args.mode == "train"
               else child_serve(args.compiler, args.shapes, args.quick, args.target))
        print(json.dumps(out), flush=True)
        return
    if args.serve:
        results = {"serve": measure_serve(args)}
        print("\n".join(serve_rows(results["serve"])))
    else:
        from zoo import MODELS
        names = args.only or [*EXAMPLES[:2], *(n for n, m in MODELS.items() if not m.inference)]
        results = {}
        for name in names:
            results[name] = measure_train(name, args)
            print(json.dumps({name: results[name]}), flush=True)
        print("\n".join(train_rows(results)))
    path = args.json or os.path.join(os.environ.get("OUT", tempfile.gettempdir()), "compile_time.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
