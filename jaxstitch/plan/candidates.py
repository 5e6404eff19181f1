"""A region's thread-mapping candidates, in the order the driver compiles them.

The planner cannot see registers: NVRTC says how many a kernel takes and whether it spills. So the
planner offers its plans in order of preference and the driver compiles them until one fits:
for each cap on threads per row (1024, 512, 256), the plan whose launch bounds leave registers for
the blocks an SM should hold, then the same with that cap lifted (one block an SM at least). A
paired kernel, or one of several rows to a warp, that spills under its cap is offered once more
with half the elements a thread (`narrower`): lifting the cap would leave one block an SM
(mapping.PAIRED_MAX_ELEMS, and mapping.choose's budget for packed rows).
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

from ..core.targets import Target
from ..graph.partition import Region
from .mapping import Tuning
from .planner import KernelPlan, RegionPlan, plan_region


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One plan to compile: planned with threads per row capped at `max_tpr`, and with the launch
    bounds' register cap lifted where `relaxed`."""

    plan: RegionPlan
    max_tpr: int
    relaxed: bool


def tprs(max_tpr: int) -> list[int]:
    """The caps on threads per row tried, in order (within the tuning's own cap)."""
    return [t for t in (1024, 512, 256) if t <= max_tpr] or [max_tpr]


def candidates(region: Region, target: Target, tuning: Tuning, first: RegionPlan | None = None
               ) -> Iterator[Candidate]:
    """The region's plans in order, planned as they are asked for. The first is `first` where given
    (planned ahead with the first cap, not relaxed); after it, a plan with no kernel, or with a
    mapping offered already, is skipped: it has nothing new to try."""
    seen, offered = set(), False
    for max_tpr in tprs(tuning.max_tpr):
        for relaxed in (False, True):
            if first is not None:
                plan, first = first, None
            else:
                plan = plan_region(region, target, dataclasses.replace(tuning, max_tpr=max_tpr), relaxed)
            if offered and (plan.kernel is None or plan.kernel.mapping in seen):
                continue
            if plan.kernel is not None:
                seen.add(plan.kernel.mapping)
            offered = True
            yield Candidate(plan=plan, max_tpr=max_tpr, relaxed=relaxed)


def narrower(region: Region, target: Target, tuning: Tuning, spilled: Candidate) -> RegionPlan | None:
    """`spilled`'s region planned with half the elements a thread, where its kernel is paired or
    packs rows several to a warp and the narrower plan keeps that; else None."""
    kernel = spilled.plan.kernel
    if (not isinstance(kernel, KernelPlan) or not (kernel.mapping.pair or kernel.mapping.tpr < 32)
            or kernel.mapping.elems_per_thread <= 2):
        return None
    tuning = dataclasses.replace(tuning, max_tpr=spilled.max_tpr, elems=kernel.mapping.elems_per_thread // 2)
    plan = plan_region(region, target, tuning)
    if not isinstance(plan.kernel, KernelPlan) or (kernel.mapping.pair and not plan.kernel.mapping.pair):
        return None
    return plan
