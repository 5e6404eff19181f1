"""The fuzzer on a GPU: random memory-bound programs (tests/fuzz_programs.py) through jaxstitch.jit
and jax.jit on the same fresh inputs, each judged against a float64 reference on the CPU.

    python3 scripts/fuzz_gpu.py --count 1200 --workers 12 [--seed 0] [--out DIR]

Workers are processes of their own (the GPU is shared; XLA's preallocation is off), each drawing
its share of the programs from its own seed with hypothesis. Half the programs are planned with the
cost model's veto lifted (strategies.force_stitching), so that most of them run kernels of ours.
Outputs are poisoned before each launch (JAXSTITCH_POISON=1: an element no kernel writes shows as
NaN), and JAXSTITCH_STRICT=1 makes an internal error a crash the fuzzer counts. Prints one line per
failing program and a summary table last; every program's record goes to DIR/fuzz_records.jsonl.
Exit status 1 if any program mismatched or crashed.

Under compute-sanitizer (memcheck over our kernels alone), run one worker and few programs:
    compute-sanitizer --tool memcheck --kernel-name kns=jaxstitch_kernel python3 scripts/fuzz_gpu.py --count 40 --workers 0
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

os.environ.setdefault("JAXSTITCH_GUARD", "0")  # (the stitched program itself, not the guard's choice)

SHOWN = 15  # failing programs printed in full (all are in the records)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def run_worker(seed: int, count: int, out_path: str, target: str | None, deadline: float) -> None:
    """Draws `count` programs from `seed` and writes one JSON record per program to `out_path`,
    until `deadline` (time.time()). `target`: plan for that GPU (on a CPU, a dry run of this
    script: regions then run as XLA)."""
    import contextlib

    for var in ("JAXSTITCH_POISON", "JAXSTITCH_STRICT"):
        os.environ.setdefault(var, "1")

    import jax
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    import jaxstitch
    from fuzz_programs import check_against_jit, fuzz_inputs, programs, reference
    from strategies import force_stitching

    jax.config.update("jax_default_matmul_precision", "highest")
    records = open(out_path, "a")

    @hseed(seed)
    @settings(max_examples=count, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(programs(), st.booleans(), st.integers(0, 2 ** 31 - 1))
    def one(program, forced, data_seed):
        if time.time() > deadline:
            return
        rec = {"program": repr(program), "forced": forced, "seed": data_seed, "grad": program.grad,
               "rank": len(program.shape), "dtypes": list(program.inputs)}
        t0 = time.perf_counter()
        try:
            fn = program.function()
            args = fuzz_inputs(program, data_seed)
            want = jax.jit(fn)(*args)
            with force_stitching() if forced else contextlib.nullcontext():
                report = jaxstitch.explain(fn, *args, target=target)
                got = jaxstitch.jit(fn, target=target)(*args)
            rec["stitched"] = sum(r.stitched for r in report.regions)
            integer = not program.floating
            ref = want if integer else reference(program, args)
            rec["failures"] = check_against_jit(got, want, ref, program.lossy)
        except Exception as e:  # noqa: BLE001 - a crash is a finding, recorded and counted
            rec["crash"] = f"{type(e).__name__}: {str(e)[:2000]}"
            rec["traceback"] = traceback.format_exc()[-4000:]
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        records.write(json.dumps(rec) + "\n")
        records.flush()

    one()


def summarize(paths: list[str]) -> int:
    recs = [json.loads(line) for p in paths if os.path.exists(p) for line in open(p)]
    crashes = [r for r in recs if "crash" in r]
    mismatches = [r for r in recs if r.get("failures")]
    for r in (mismatches + crashes)[:SHOWN]:
        print("FAIL", "(forced)" if r["forced"] else "(default)", f"seed={r['seed']}")
        print("  " + r["program"].replace("\n", "\n  "))
        for line in r.get("failures", []) or [r.get("crash", "")]:
            print("  ->", line[:600])
    ran = [r for r in recs if "crash" not in r]
    by = {}
    for r in recs:
        key = ("grad" if r["grad"] else "forward", "int" if r["dtypes"][0].startswith(("int", "uint")) else "float")
        by.setdefault(key, []).append(r)
    print("\n| programs | kind | with a stitched kernel | mismatches | crashes |")
    print("|---:|---|---:|---:|---:|")
    for key, rs in sorted(by.items()):
        print(f"| {len(rs)} | {' '.join(key)} | {sum(1 for r in rs if r.get('stitched'))} | "
              f"{sum(1 for r in rs if r.get('failures'))} | {sum(1 for r in rs if 'crash' in r)} |")
    print(f"| {len(recs)} | all | {sum(1 for r in ran if r.get('stitched'))} | {len(mismatches)} | {len(crashes)} |")
    return 1 if crashes or mismatches else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--workers", type=int, default=8, help="0: run in this process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/jaxstitch_fuzz"), help="the merged records")
    ap.add_argument("--work", default="/tmp/jaxstitch_fuzz_work", help="the workers' records")
    ap.add_argument("--seconds", type=float, default=1e9, help="stop drawing programs after this long")
    ap.add_argument("--target", default=None, help="plan for this GPU (a dry run on a CPU)")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    deadline = time.time() + args.seconds if args.worker is None else args.seconds
    if args.worker is not None or args.workers == 0:
        k = args.worker or 0
        run_worker(args.seed * 1000 + k, args.count, os.path.join(args.work, f"fuzz_records_{k}.jsonl"), args.target,
                   deadline)
        if args.workers:
            return
        sys.exit(summarize([os.path.join(args.work, f"fuzz_records_{k}.jsonl")]))
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", JAXSTITCH_POISON="1", JAXSTITCH_STRICT="1",
               PYTHONUNBUFFERED="1")
    share = -(-args.count // args.workers)
    for k in range(args.workers):  # (records of an earlier run)
        if os.path.exists(os.path.join(args.work, f"fuzz_records_{k}.jsonl")):
            os.remove(os.path.join(args.work, f"fuzz_records_{k}.jsonl"))
    target = ["--target", args.target] if args.target else []
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(k), "--count", str(share),
                               "--seed", str(args.seed), "--out", args.out, "--work", args.work,
                               "--seconds", str(deadline), *target], env=env)
             for k in range(args.workers)]
    for p in procs:
        p.wait()
    paths = [os.path.join(args.work, f"fuzz_records_{k}.jsonl") for k in range(args.workers)]
    with open(os.path.join(args.out, "fuzz_records.jsonl"), "w") as f:
        for p in paths:
            if os.path.exists(p):
                f.write(open(p).read())
    sys.exit(summarize(paths))


if __name__ == "__main__":
    main()
