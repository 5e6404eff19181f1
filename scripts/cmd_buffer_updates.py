"""How often XLA records a train step's command buffers again, and what that costs the host, under
jax.jit and jaxstitch.jit: with steps in flight, and with one step at a time.

    python3 scripts/cmd_buffer_updates.py --model bert [--steps 10] [--tune xla_kernels=1 ...]

Why: a BERT step's host time grew by 4.8 ms under jaxstitch.jit with steps in flight, not under
jax.jit (H100). XLA records a command buffer again when an allocation its
commands use moved (`CommandBufferThunk::ExecuteOnStream`), and logs each update with its time at
verbosity 3 of command_buffer_thunk. Each variant runs in a child process with that logging on; the
parent counts the child's "Updated command buffer in N μs" lines per phase. A jaxlib whose logging
ignores TF_CPP_VMODULE shows no lines at all, which the table says.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MARK = "jaxstitch-phase:"


def child(args):
    sys.path[:0] = [HERE, os.path.join(HERE, "..", "examples")]
    import jax

    import jaxstitch
    from example_models import load_example

    example, init, batches = load_example(args)
    batch = batches(0)
    graphdef, state = init()
    jit = jax.jit if args.variant == "jax.jit" else jaxstitch.jit
    tuned = {"tuning": args.spec} if args.spec and jit is jaxstitch.jit else {}
    f = jit(example.train_step, static_argnums=(0,), donate_argnums=(1,), **tuned)
    _, state = f(graphdef, state, batch)
    jax.block_until_ready(state)
    for phase in ("in flight", "alone"):
        print(MARK + phase, file=sys.stderr, flush=True)
        for _ in range(args.steps):
            _, state = f(graphdef, state, batch)
            if phase == "alone":
                jax.block_until_ready(state)
        jax.block_until_ready(state)
    print(MARK + "end", file=sys.stderr, flush=True)


def parse(stderr: str) -> dict[str, list[float]]:
    """{phase: [µs of each update]} from the child's log."""
    phase, found = None, {}
    for line in stderr.splitlines():
        if line.startswith(MARK):
            phase = line[len(MARK):]
            found.setdefault(phase, [])
            continue
        m = re.search(r"Updated command buffer in (\d+)", line)
        if m and phase is not None:
            found[phase].append(float(m.group(1)))
    return found


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bert", choices=["bert", "gpt", "dien"])
    p.add_argument("--dtype", default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tune", nargs="*", default=[], help="JAXSTITCH_TUNE specs, one jaxstitch.jit variant each")
    p.add_argument("--child", nargs=2, metavar=("VARIANT", "SPEC"), help=argparse.SUPPRESS)
    args = p.parse_args()
    args.seq = args.batch = None
    if args.child:
        args.variant, args.spec = args.child
        return child(args)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="command_buffer_thunk=3")
    print(f"{args.model} {args.dtype or 'float32'}: command buffer updates over {args.steps} steps "
          "(count, median µs, total ms)")
    seen = 0
    for variant, spec in [("jax.jit", ""), ("jaxstitch.jit", "")] + [("jaxstitch.jit", s) for s in args.tune]:
        cmd = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--steps", str(args.steps),
               "--child", variant, spec] + (["--dtype", args.dtype] if args.dtype else [])
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        found = parse(run.stderr)
        name = f"{variant} {spec}".strip()
        if run.returncode != 0:
            print(f"  {name:32s} failed ({run.returncode}): {run.stderr.strip().splitlines()[-1:]}")
            continue
        cells = []
        for phase in ("in flight", "alone"):
            us = found.get(phase, [])
            seen += len(us)
            cells.append(f"{phase}: {len(us):4d}, {statistics.median(us) if us else 0:8.0f}, {sum(us) / 1e3:7.2f}")
        print(f"  {name:32s} " + " | ".join(cells))
    if not seen:
        print("(no update logged at all: no command buffers here, or this jaxlib's logging ignores "
              "TF_CPP_VMODULE)")


if __name__ == "__main__":
    main()
