"""Draw the training examples' step times (the JSON files `examples/*_train.py --json` writes) as one
SVG bar chart: per model, jax.jit's and jaxstitch.jit's step time relative to jax.jit's, labelled
with the milliseconds and the speedup. Plain SVG, so it needs nothing beyond the standard library.

    python scripts/plot_steps.py docs/results/*.json -o docs/train_steps.svg
"""
from __future__ import annotations

import argparse
import json
from html import escape

BAR, GAP, LEFT, WIDTH, TOP = 18, 16, 260, 420, 46
COLORS = {"jax.jit": "#9aa5b1", "jaxstitch.jit": "#2f6fb0"}


def label(record: dict) -> str:
    """'BERT masked-LM train step Config(...)' -> 'BERT masked-LM (float32)'."""
    title = record["title"].split(" train step")[0]
    dtype = "bfloat16" if "bfloat16" in record["title"] else "float32"
    return f"{title} ({dtype})"


def svg(records: list[dict]) -> str:
    rows = []
    y = TOP
    for r in records:
        runs = {run["name"]: run for run in r["runs"]}
        ref = runs["jax.jit"]["step_ms"]
        speedup = ref / runs["jaxstitch.jit"]["step_ms"]
        rows.append(f'<text x="{LEFT - 10}" y="{y + BAR + 4}" text-anchor="end">{escape(label(r))}</text>')
        rows.append(f'<text x="{LEFT - 10}" y="{y + 2 * BAR + 2}" text-anchor="end" class="small">'
                    f'{escape(r["device"])}, {speedup:.2f}x</text>')
        for name in ("jax.jit", "jaxstitch.jit"):
            ms = runs[name]["step_ms"]
            w = WIDTH * ms / ref
            rows.append(f'<rect x="{LEFT}" y="{y}" width="{w:.1f}" height="{BAR - 2}" fill="{COLORS[name]}"/>')
            rows.append(f'<text x="{LEFT + w + 6:.1f}" y="{y + BAR - 5}" class="small">{ms:.2f} ms</text>')
            y += BAR
        y += GAP
    legend = "".join(
        f'<rect x="{LEFT + 150 * i}" y="14" width="12" height="12" fill="{c}"/>'
        f'<text x="{LEFT + 150 * i + 18}" y="24">{n}</text>' for i, (n, c) in enumerate(COLORS.items()))
    height = y + 10
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + 90}" height="{height}" '
            f'font-family="sans-serif" font-size="13">\n<style>.small {{ font-size: 11px; fill: #444; }}</style>\n'
            f'<text x="10" y="24" font-weight="bold">Train step time (jax.jit = 1)</text>\n{legend}\n'
            + "\n".join(rows) + "\n</svg>\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="JSON files written by the examples' --json")
    p.add_argument("-o", "--output", default="train_steps.svg")
    args = p.parse_args()
    records = [json.load(open(path)) for path in args.results]
    records = [r for r in records if "runs" in r]  # (docs/results/ also holds the benchmark's tables)
    with open(args.output, "w") as f:
        f.write(svg(records))
    print(f"wrote {args.output} ({len(records)} models)")


if __name__ == "__main__":
    main()
