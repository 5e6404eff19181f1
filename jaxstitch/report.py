"""What `jaxstitch.explain` returns: per region, what was stitched, how, and why not."""
from __future__ import annotations

import dataclasses

from .kernels.cache import Stats
from .pipeline import Program


@dataclasses.dataclass(frozen=True)
class RegionReport:
    index: int
    ops: tuple[str, ...]
    stitched: bool
    kernels: int              # launches for this region: 1 when stitched, else XLA's (estimated)
    scheme: str | None        # local (registers) / regional (shared memory) / global (grid barrier)
    mapping: str | None
    rows: int | None
    cols: int | None
    grid: int | None
    block: int | None
    est_bytes: int | None
    est_us: float | None
    xla_kernels: int | None
    xla_est_us: float | None
    reason: str | None
    cache_key: str | None
    smem_bytes: int | None = None     # dynamic shared memory per block (the stash)
    registers: int | None = None      # per thread, as compiled
    alternatives: tuple[str, ...] = ()  # mappings compiled first, and why each lost
    where: str = ""                   # the control-flow body holding the region ("" at top level)
    variants: tuple[str, ...] = ()    # a family's kernels for fewer rows: "below N rows: mapping" (or XLA's)

    @property
    def name(self) -> str:
        return f"{self.where}:{self.index}" if self.where else str(self.index)


@dataclasses.dataclass(frozen=True)
class Report:
    target: str
    regions: tuple[RegionReport, ...]
    xla_ops: tuple[tuple[str, str], ...]   # (primitive, why it stays with XLA), one per distinct pair
    # Where this plan's cubins came from: NVRTC runs, the disk cache, this process's memory (a warm
    # start shows nvrtc_compiles == 0; a new row count of a known family, memory or disk hits only).
    cache: Stats | None = None
    symbolic: bool = False                 # planned for symbolic dimensions (rows x cols: the first sample)
    seconds: float | None = None           # jaxstitch's own time: trace, partition, plan, codegen, NVRTC
    # Equations the trace wrote out as the elementwise ops they are, so that regions take them in:
    # (primitive, count), e.g. dropout's random_bits (prng.py), take_along_axis's gradient's
    # scatter-add into zeros (row_scatter.py).
    rewritten: tuple[tuple[str, int], ...] = ()

    @property
    def stitched_kernels(self) -> int:
        return sum(r.kernels for r in self.regions if r.stitched)

    def __str__(self) -> str:
        head = (f"jaxstitch plan for {self.target}: {len(self.regions)} regions, "
                f"{sum(r.stitched for r in self.regions)} stitched into {self.stitched_kernels} kernels")
        if self.symbolic:
            head += " (symbolic dimensions: shape families; rows x cols at the first sample size)"
        if self.cache is not None:
            head += (f"; cubins: {self.cache.nvrtc_compiles} compiled by NVRTC, {self.cache.disk_hits} from "
                     f"the disk cache, {self.cache.memory_hits} from memory")
        if self.seconds is not None:
            head += f"; planned in {self.seconds:.2f} s"
            if self.cache is not None and self.cache.nvrtc_compiles:
                head += f" ({self.cache.nvrtc_seconds:.2f} s in NVRTC)"
        cols = ("#", "ops", "stitched", "kernels", "scheme", "mapping", "rows x cols", "est us", "xla us", "reason")
        rows = []
        for r in self.regions:
            ops = f"{len(r.ops)}: " + ",".join(sorted(set(r.ops)))[:40]
            rows.append((r.name, ops, "yes" if r.stitched else "no",
                         str(r.kernels), r.scheme or "-", "; ".join([r.mapping or "-", *r.variants]),
                         f"{r.rows}x{r.cols}" if r.rows else "-",
                         f"{r.est_us:.1f}" if r.est_us is not None else "-",
                         f"{r.xla_est_us:.1f}" if r.xla_est_us is not None else "-",
                         r.reason or ""))
        widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
        lines = [head, "  ".join(c.ljust(w) for c, w in zip(cols, widths))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
        for r in self.regions:
            for alt in r.alternatives:
                lines.append(f"  region {r.name} tried {alt}")
        if self.rewritten:
            lines.append("written out as other ops: " + ", ".join(
                f"{n} {p} ({_WRITTEN_OUT.get(p, '')})" if p in _WRITTEN_OUT else f"{n} {p}" for p, n in self.rewritten))
        if self.xla_ops:
            lines.append("left to XLA: " + "; ".join(f"{p} ({why})" for p, why in self.xla_ops))
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):  # IPython
        p.text(str(self))


_WRITTEN_OUT = {"random_bits": "threefry's integer ops: prng.py",
                "scatter-add": "into a fill, one value a row or one window, as a select: row_scatter.py",
                "scatter-add in float32": "half precision into a fill, added in float32, rounded once: "
                                          "wide_scatter.py",
                "matrix products merged": "into products of concatenations their producers write: "
                                          "merged_products.py",
                "transposed products folded": "the product written with its operands swapped: "
                                              "transposed_products.py",
                "conversions to bfloat16 unrounded": "only arithmetic reads them, as XLA's excess "
                                                     "precision: wide_converts.py"}


def make_report(program: Program, cache: Stats | None = None, symbolic: bool = False,
                seconds: float | None = None) -> Report:
    regions = []
    for where, c in program.all_regions():
        plan, k, est = c.plan, c.plan.kernel, c.plan.estimate
        m = k.mapping if k else None
        regions.append(RegionReport(
            index=plan.region.id, ops=tuple(op.prim for op in plan.region.ops), stitched=c.stitched,
            kernels=1 if c.stitched else (est.xla_kernels if est else 1),
            scheme=k.scheme if k else None, mapping=_described(k),
            rows=m.n_rows if m else None, cols=m.n_cols if m else None,
            grid=m.grid if m else None, block=m.block if m else None,
            est_bytes=est.bytes if est else None, est_us=est.us if est else None,
            xla_kernels=est.xla_kernels if est else None, xla_est_us=est.xla_us if est else None,
            reason=c.reason, cache_key=c.key, smem_bytes=m.smem_bytes if m else None,
            registers=c.registers, alternatives=c.tried + _passed_over(k), where=where,
            variants=(((f"below {c.xla_below} rows: XLA's kernels",) if c.xla_below else ())
                      + tuple(f"below {n} rows: {v.plan.kernel.description}" for n, v in c.variants))))
    seen, rewritten = [], {}
    for p in _programs(program):
        ops = p.traced.graph.ops
        for idx, why in p.partition.unsupported:
            pair = (ops[idx].prim, why)
            if pair not in seen:
                seen.append(pair)
        for prim, n in p.traced.rewritten:
            rewritten[prim] = rewritten.get(prim, 0) + n
    return Report(program.target.name, tuple(regions), tuple(seen), cache, symbolic, seconds,
                  tuple(sorted(rewritten.items())))


def _described(kernel) -> str | None:
    """The kernel's description, and the rounds of tasks its planned grid walks where rows are split
    in more than one (not in the kernel's source, which serves every row count)."""
    if kernel is None:
        return None
    m = kernel.mapping
    rounds = getattr(m, "rounds", 1)
    return kernel.description + (f", tasks in {rounds} rounds" if rounds > 1 else "")


def _passed_over(kernel) -> tuple[str, ...]:
    """A pairing of the row's halves the planner found but could not map (plan/pairs.py), a warp on
    each tile it planned but did not take (plan/tile.py), or a split in one round of tasks it gave
    up for more rounds with more of each slice stashed (plan/mapping._stash_in_rounds), and why."""
    why = getattr(kernel, "unpaired", None) or getattr(kernel, "declined", None)
    if why:
        return (why,)
    one_round = getattr(getattr(kernel, "mapping", None), "one_round", ())
    if one_round:
        k, held, chunks = one_round
        m = kernel.mapping
        return (f"rows split over {k} blocks in one round, {held} of {chunks} chunks stashed: less than "
                f"half of each slice, where {m.splits} slices in {m.rounds} rounds stash "
                f"{m.stashed_chunks} of {m.chunks}",)
    return ()


def _programs(program: Program):
    yield program
    for _, _, body in program.bodies:
        yield from _programs(body)
