"""The training examples by name, for the scripts that time or probe a whole train step."""
import argparse
import dataclasses
import importlib


def model_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default="bert", choices=["bert", "gpt", "dien"])
    p.add_argument("--dtype", default=None, help="bert and gpt: activations' dtype")
    return p


def load_example(args):
    """(example module, init, batch) for the --model and --dtype asked for, seed 0 (examples/ must
    be on sys.path)."""
    example = importlib.import_module(f"{args.model}_train")
    c = example.Config()
    if args.dtype:
        c = dataclasses.replace(c, dtype=args.dtype)
    return example, example.make_init(c, 0), example.make_batches(c, 0)
