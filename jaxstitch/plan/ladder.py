"""Split-row variants of a long-row shape family: the ladder of kernels for few rows.

A family's kernel for long rows runs a block a row, which leaves most SMs idle when a served
request brings a few rows (one short sequence over a vocabulary of 256k). For such row counts the
same region is planned with each row split over several blocks: one rung per (split count, tasks
an SM) at LADDER_ROWS, where the cost model expects it to beat the member there. The driver
(integration/families.py) compiles each rung at both sample sizes and keeps those both agree on;
`rows_to_rungs` then gives each row count the rung whose busiest SM reads least, and `xla_below`
the row count below which XLA's kernels are expected faster than all of them.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..core.targets import Target
from . import mapping as mapping_mod
from .layout import FULL
from .mapping import Tuning, busiest_sm_share, tasks_per_sm
from .planner import RegionPlan, estimate_rows, plan_region

# The row counts whose split counts (mapping.split_count: at most one (row, slice) task per SM, or
# two where one leaves over a fifth of the SMs idle) make a long-row family's rungs of split
# variants, close enough that each row count finds one that keeps most SMs busy: with four rungs
# (1, 8, 32, 64 rows: 64, 16, 4 and 2 slices) the rows just past a bound ran 0.74-0.94x of jax.jit
# (H100, 262144 float32: 3, 9, 16 and 34 rows), the rows filling a rung 0.99-1.85x. Rungs at 4 and
# 8 rows (33 and 16 slices) lost to the first rung's small slices (below); 17 rows ran 17.0 us on 6
# slices (0.95x), 15.6 on 7 (1.05x), 14.9 on 15 two to an SM stashed whole (1.11x, `_rung_splits`);
# 34 rows 27.6 us on 3 slices (0.97x), 26.9-27.8 on 7 two to an SM (0.98-1.01x); 67 rows 59.0 us a
# block per row, 44.9 on 3 slices two to an SM (1.73x).
LADDER_ROWS = (1, 16, 17, 20, 24, 32, 34, 44, 47, 64, 67)
# A stashed slice this small runs up to four to an SM (H100, 262144 float32: 64 slices of 16 KB at 4
# and 8 rows 9.2 and 10.9 us, jax.jit 10.3 and 12.2; 33 and 16 slices one to an SM there 9.7 and
# 12.9 us). Larger ones one or two to an SM: 33 slices of 32 KB up to four to an SM ran 9 and 16
# rows at 0.60x.
SMALL_SLICE_BYTES = 16 * 1024
SMALL_SLICES_PER_SM = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class RungPlan:
    """A rung worth compiling: `splits` blocks a row, up to `per_sm` tasks to an SM, planned with
    `tuning` (forced past the cost model's verdict, which priced the samples' many rows) and
    expected to beat the member at `rows` rows."""

    rows: int
    splits: int
    per_sm: int
    tuning: Tuning


def rung_plans(member: RegionPlan, target: Target, tuning: Tuning) -> tuple[RungPlan, ...]:
    """The rungs to compile for a member whose long rows run a block each (none for others, or
    with `tuning.variants` off): each (split count, tasks per SM) of `_rung_splits` once, where the
    split plan is expected faster than the member at the rung's rows."""
    m = member.kernel.mapping
    if m.chunks == 1 or m.splits > 1 or not tuning.variants:
        return ()
    planned: list[RungPlan] = []
    for n, k in _rung_splits(m, target):
        per_sm = tasks_per_sm(n, k, target)
        if k < 2 or any((k, per_sm) == (p.splits, p.per_sm) for p in planned):
            continue
        forced = dataclasses.replace(tuning, splits=k, min_gain_pct=0, split_rows=target.sm_count * per_sm // k)
        plan = plan_region(member.region, target, forced)
        if plan.kernel is None or plan.kernel.mapping.splits < 2:
            continue
        if estimate_rows(plan, n, target).us >= estimate_rows(member, n, target).us:
            continue
        planned.append(RungPlan(rows=n, splits=k, per_sm=per_sm, tuning=forced))
    return tuple(planned)


@dataclasses.dataclass(frozen=True)
class Rung:
    """A split variant of a long-row family: `splits` blocks a row, up to `per_sm` (row, slice)
    tasks to an SM (its stash sized for that), so it runs up to `most_rows` rows in one round;
    `variant` is what the driver made of it (its compiled kernel)."""
    splits: int
    per_sm: int
    most_rows: int
    variant: Any
    whole: bool = False  # two tasks to an SM whose slices their stash holds whole


def rung(plan: RegionPlan, per_sm: int, target: Target, variant: Any) -> Rung:
    """The rung a compiled split plan makes: a small stashed slice runs up to four to an SM, and
    two tasks to an SM count as whole where their stash holds the slices whole (or nothing is kept
    for a later pass)."""
    vm = plan.kernel.mapping
    runs = per_sm
    if _slice_bytes(plan) <= SMALL_SLICE_BYTES:
        runs = max(per_sm, min(SMALL_SLICES_PER_SM, vm.max_grid // target.sm_count))
    whole = per_sm == 2 and vm.chunks > 1 and (vm.stash == mapping_mod.REGISTERS or (
        vm.stash == mapping_mod.SHARED and vm.stashed_chunks == vm.chunks))
    return Rung(vm.splits, runs, target.sm_count * runs // vm.splits, variant, whole)


def _slice_bytes(plan: RegionPlan) -> int:
    """Bytes of a split variant's slice of the row inputs (those its passes read)."""
    layout = plan.kernel.layout
    return plan.kernel.mapping.slice_cols * sum(
        x.itemsize for x in plan.kernel.region.inputs if layout.of(x).storage == FULL)


def _rung_splits(m: mapping_mod.Mapping, target: Target):
    """(rows, split count) of each rung to try: split_count's at LADDER_ROWS, and twice the slices
    of one task per SM where that makes the busiest SM read less (two to an SM; kept where they
    stash whole: `mapping._two_per_sm_whole`)."""
    for n in LADDER_ROWS:
        one = mapping_mod.split_count(n, m.n_cols, m.vec, target)
        yield n, one
        two = mapping_mod.two_per_sm_splits(n, m.n_cols, m.vec, target)
        if two and two != one:
            yield n, two


def rows_to_rungs(rungs: tuple[Rung, ...], m: mapping_mod.Mapping, target: Target) -> tuple[tuple[int, Any], ...]:
    """(bound, variant) pairs in the launcher's order (it takes the first whose bound exceeds the
    rows): each row count up to the rungs' most goes to the rung that holds it in one round and
    whose busiest SM reads least; two tasks of large slices to an SM only where their stash holds
    them whole or where the member's mapping would split the rows so (`mapping.split_count`: one
    to an SM leaves over a fifth of them idle). Ties go to more slices (H100, 8 rows of 256k: 64
    slices four to an SM 10.9 us, 16 one to an SM 12.9), then to a stash sized for fewer tasks per
    SM (it holds more). A rung that wins two separate ranges appears twice. The ladder ends at the
    first row count no rung takes: the member runs from there on."""
    out: list[tuple[int, Any]] = []
    for rows in range(1, max((r.most_rows for r in rungs), default=0) + 1):
        two = rows * mapping_mod.split_count(rows, m.n_cols, m.vec, target) > target.sm_count
        fit = [r for r in rungs if rows <= r.most_rows
               and (two or r.whole or r.per_sm > 2 or tasks_per_sm(rows, r.splits, target) == 1)]
        if not fit:
            break
        best = min(fit, key=lambda r: (busiest_sm_share(rows, r.splits, target), -r.splits, r.per_sm))
        if out and out[-1][1] is best.variant:
            out[-1] = (rows + 1, best.variant)
        else:
            out.append((rows + 1, best.variant))
    return tuple(out)


def _row_counts(most: int) -> list[int]:
    """Row counts to weigh a family's kernels at: 1, 2, 3, 4, 6, 8, 12, ... up to `most`."""
    out, n = [], 1
    while n <= most:
        out += [n] if n < 2 else [n, n * 3 // 2] if n * 3 // 2 <= most else [n]
        n *= 2
    return sorted(set(out))


def xla_below(member: RegionPlan, variants, target: Target) -> int:
    """The row count below which XLA's kernels are expected faster than the family's own (the cost
    model priced the samples' many rows; one long row of a 256k vocabulary takes a block 32 us where
    XLA spreads it over the GPU in 9 us, H200): 0 when ours are expected to win from one row on.
    Below it the program runs the region's jaxpr (a conditional on the row count that XLA resolves
    when it compiles the program for actual sizes). `variants`: the ladder's (bound, plan,
    registers), a variant weighed at the row counts below its bound."""
    m = member.kernel.mapping
    for n in _row_counts(target.sm_count * m.rows_per_block):
        est = estimate_rows(member, n, target)
        ours = min([est.us] + [estimate_rows(plan, n, target, registers).us
                               for below, plan, registers in variants if n < below])
        if ours < est.xla_us:
            return 0 if n == 1 else n
    return target.sm_count * m.rows_per_block + 1
