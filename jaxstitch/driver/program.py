"""What the pipeline makes of a function: each region compiled or left to XLA, and the program."""
from __future__ import annotations

import dataclasses

from ..core.targets import Target
from ..frontend import trace as trace_mod
from ..graph import partition as partition_mod
from ..plan import RegionPlan
from . import build_times


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A region after codegen and NVRTC: source and cubin, or the error that sent it back to XLA."""

    plan: RegionPlan
    source: str | None
    key: str | None
    cubin: bytes | None = dataclasses.field(repr=False)
    error: str | None
    spilled: bool = False
    registers: int | None = None   # per thread, as NVRTC compiled it
    tried: tuple[str, ...] = ()    # mappings compiled before this one, and why each lost
    # A shape family's member (families.py): (buffer, elements per row) to read the row count off
    # at run time; None: the sizes are the planned ones.
    rows_source: tuple[int, int] | None = None
    # A family member's other kernels, each for fewer rows than its bound: (below_rows, Compiled),
    # e.g. rows split over several blocks where too few rows would leave SMs idle. The launcher
    # picks by the row count at run time.
    variants: tuple[tuple[int, "Compiled"], ...] = ()
    xla_below: int = 0  # a family member: below this many rows XLA's kernels run instead (families.py)

    @property
    def stitched(self) -> bool:
        return self.plan.stitched and self.cubin is not None

    @property
    def reason(self) -> str | None:
        return self.plan.reason or self.error


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A function as the pipeline built it: its trace and partition, every region compiled or left to
    XLA (with the reason), and its control-flow bodies built as programs of their own."""

    traced: trace_mod.Traced
    partition: partition_mod.Partition
    regions: tuple[Compiled, ...]
    target: Target
    # control-flow bodies, each planned as a program of its own: (equation index, body key, program)
    bodies: tuple[tuple[int, tuple[str, int], "Program"], ...] = ()
    times: build_times.BuildTimes | None = None  # where the build's seconds went (families.build_any)

    @property
    def stitched(self) -> bool:
        """Whether any region here or in a body runs as our kernel."""
        return any(c.stitched for c in self.regions) or any(b.stitched for _, _, b in self.bodies)

    def all_regions(self, where: str = ""):
        """(where, Compiled) for every region, those of bodies after the program's own; `where`
        names the body ("scan", "while.body_jaxpr", "cond.branches[1]", nested with "/")."""
        for c in self.regions:
            yield where, c
        eqns = self.traced.eqns
        for i, (name, k), body in self.bodies:
            prim = eqns[i].primitive.name
            label = prim if prim == "scan" else f"{prim}.{name}" + (f"[{k}]" if name == "branches" else "")
            yield from body.all_regions(f"{where}/{label}" if where else label)
