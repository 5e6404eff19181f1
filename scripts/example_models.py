"""The training examples by name, for the scripts that time or probe a whole train step."""
import argparse
import dataclasses
import importlib


def model_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default="bert", choices=["bert", "gpt", "dien"])
    p.add_argument("--dtype", default=None, help="bert and gpt: activations' dtype")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the example's)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the example's)")
    return p


def load_example(args):
    """(example module, init, batch) for the --model, --dtype, --seq and --batch asked for, seed 0 (examples/ must
    be on sys.path)."""
    example = importlib.import_module(f"{args.model}_train")
    changes = {name: getattr(args, name) for name in ("dtype", "seq", "batch")
               if getattr(args, name, None) is not None}
    c = dataclasses.replace(example.Config(), **changes)
    return example, example.make_init(c, 0), example.make_batches(c, 0)
