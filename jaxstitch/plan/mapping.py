"""Adaptive thread mapping for row kernels, chosen from the row length and register budget.

Short rows pack several rows into one warp (TPR < 32 lanes per row: horizontal packing), medium rows
take a warp, long rows a whole block (reduced through shared memory: AStitch's regional scheme). Each
thread keeps E elements of its row per live array in registers; E is bounded so that the arrays fit.
"""
from __future__ import annotations

import dataclasses
import math

from .. import ir
from ..targets import Target
from .layout import COL, FULL, Layout, Unplannable

MAX_ELEMS_PER_THREAD = 32


@dataclasses.dataclass(frozen=True)
class Mapping:
    n_rows: int
    n_cols: int
    vec: int              # elements per vector access
    tpr: int              # threads per row
    vpt: int              # vectors per thread per row
    rows_per_block: int
    block: int
    grid: int             # upper bound; a cooperative launch clamps it to the resident blocks
    cooperative: bool

    @property
    def elems_per_thread(self) -> int:
        return self.vec * self.vpt

    @property
    def name(self) -> str:
        if self.tpr < 32:
            return f"{32 // self.tpr} rows per warp"
        if self.tpr == 32:
            return "warp per row"
        if self.tpr == self.block:
            return "block per row"
        return f"{self.tpr // 32} warps per row"


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def choose(layout: Layout, region_io: list[ir.Value], n_live_arrays: int, grid_reduced: bool,
           target: Target, max_tpr: int = 1024) -> Mapping:
    n, c = layout.n_rows, layout.n_cols
    wide = [p.value for p in layout.values if p.storage in (FULL, COL) and p.value in region_io]
    vec = min([16 // v.itemsize for v in wide] + [8])
    while vec > 1 and c % vec:
        vec //= 2
    # About 64 registers of held elements per thread leaves room for temporaries and 2-3 blocks per SM.
    budget = max(vec, 4, min(MAX_ELEMS_PER_THREAD, _pow2_at_least(64 // max(1, n_live_arrays) + 1) // 2))
    tpr = min(max_tpr, _pow2_at_least(math.ceil(c / budget)))
    tpr = max(1, min(tpr, _pow2_at_least(math.ceil(c / vec))))
    vpt = math.ceil(c / (tpr * vec))
    if vpt * vec > 2 * MAX_ELEMS_PER_THREAD:
        raise Unplannable(f"rows of {c} elements need {vpt * vec} registers per thread and array; "
                          "splitting long rows over blocks is not implemented yet")
    rows_per_block = max(1, 256 // tpr)
    block = tpr * rows_per_block
    groups = math.ceil(n / rows_per_block)
    per_sm = max(1, target.max_threads_per_sm // block)
    if grid_reduced:  # partials per block go through global memory: keep the grid near one wave
        per_sm = max(1, min(per_sm, 1024 // block))
    grid = max(1, min(groups, target.sm_count * per_sm))
    return Mapping(n, c, vec, tpr, vpt, rows_per_block, block, grid, grid_reduced)
