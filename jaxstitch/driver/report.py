"""What `jaxstitch.explain` returns: per region, what was stitched, how, and why not."""
from __future__ import annotations

import dataclasses
import textwrap

from ..core.ops import REDUCTIONS, SCANS
from ..frontend import trace as trace_mod
from ..kernels import cache as cache_mod
from ..kernels.cache import Stats
from .build_times import BuildTimes
from .program import Program
from .progress import counted


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
    source: str = ""                  # the user's line that made the op the reason names, where it names one
    # What kind of obstacle the reason is (plan.layout.ReasonKind's value: "layout", "op", "dtype",
    # "resources", "tile", "scan", "cost"), for grouping reasons without reading their text; None
    # when stitched or where the reason is the pipeline's own (an NVRTC failure, say).
    reason_kind: str | None = None

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
    xla_counts: tuple[int, ...] = ()       # equations behind each xla_ops pair, in its order (): not counted
    times: BuildTimes | None = None        # the build's seconds by stage (build_times.py)

    @property
    def stitched_kernels(self) -> int:
        return sum(r.kernels for r in self.regions if r.stitched)

    def __str__(self) -> str:
        return "\n".join(self._head() + _table(self.regions) + self._rewritten() + self._left_to_xla())

    def _head(self) -> list[str]:
        """What was planned, where the cubins came from, and the time it took (NVRTC's share as the
        wall time it ran, beside its CPU time summed over the compiles running side by side)."""
        n, stitched = len(self.regions), sum(r.stitched for r in self.regions)
        head = f"jaxstitch plan for {self.target}: {counted(n, 'region')}"
        if stitched:
            head += f": {stitched} stitched into {counted(self.stitched_kernels, 'kernel')}"
            head += f", {n - stitched} left to XLA" if n - stitched else ""
        elif n:
            head += ", none stitched"
        lines = [head] + self._kinds_left()
        if self.symbolic:
            lines.append("symbolic dimensions: shape families; rows x cols at the first sample size")
        c = self.cache
        if c is not None:
            line = (f"cubins: {c.nvrtc_compiles} compiled by NVRTC, {c.disk_hits} from the disk cache, "
                    f"{c.memory_hits} from memory")
            if c.discarded:
                line += f"; {counted(c.discarded, 'corrupt cache entry', 'corrupt cache entries')} discarded"
            lines.append(line)
        if self.seconds is not None:
            line = f"built in {self.seconds:.2f} s"
            if c is not None and c.nvrtc_compiles:
                line += (f", NVRTC running for {min(c.nvrtc_busy_seconds, self.seconds):.2f} s of them "
                         f"({c.nvrtc_seconds:.2f} s of CPU time on up to {counted(cache_mod.THREADS, 'thread')})")
            lines.append(line)
        if self.times is not None:  # (NVRTC: the time the build waited on it, beside planning)
            lines += _wrapped("built in stages: " + self.times.stages_text(), "", "  ")
        return lines

    def _kinds_left(self) -> list[str]:
        """The regions left to XLA counted by their reason's kind ('layout 3, cost 2'), most first."""
        n: dict[str, int] = {}
        for r in self.regions:
            if not r.stitched and r.reason_kind:
                n[r.reason_kind] = n.get(r.reason_kind, 0) + 1
        if not n:
            return []
        kinds = ", ".join(f"{k} {n[k]}" for k in sorted(n, key=lambda k: (-n[k], k)))
        return _wrapped("left to XLA by kind of reason: " + kinds, "", "  ")

    def _rewritten(self) -> list[str]:
        if not self.rewritten:
            return []
        lines = ["written out as other ops:"]
        for p, n in self.rewritten:
            lines += _wrapped(f"{n} {p}" + (f" ({_WRITTEN_OUT[p]})" if p in _WRITTEN_OUT else ""), "  ", "      ")
        return lines

    def _left_to_xla(self) -> list[str]:
        """One line for each reason the trace's equations stay with XLA, with the equations counted;
        primitives whose reasons differ in their names alone share a line ('gather x5, sort x2 is not
        a stitchable primitive: 7 equations')."""
        if not self.xla_ops:
            return []
        counts = self.xla_counts if len(self.xla_counts) == len(self.xla_ops) else None
        groups: dict[tuple[str, bool], list[tuple[str, int]]] = {}
        for k, (prim, why) in enumerate(self.xla_ops):
            named = why.startswith(prim + " ")
            groups.setdefault((why[len(prim):] if named else why, named), []).append(
                (prim, counts[k] if counts else 0))
        total = sum(counts) if counts else None
        lines = ["left to XLA" + (f" ({counted(total, 'equation')}):" if counts else ":")]
        for (why, named), members in sorted(groups.items(), key=lambda g: -sum(n for _, n in g[1])):
            each = len(members) > 1 and counts  # (one primitive: the count at the end says it all)
            prims = ", ".join(p + (f"{_KEEP}x{n}" if each else "") for p, n in members)
            text = f"{prims}{why}" if named else f"{why} ({prims})"
            if counts:
                text += ": " + counted(sum(n for _, n in members), "equation").replace(" ", _KEEP)
            lines += _wrapped(text, "  ", "      ")
        return lines

    def _repr_pretty_(self, p, cycle):  # IPython
        p.text(str(self))


WIDTH = 100  # of the report's lines: wrapped at spaces (a longer word stays whole)
_COLUMNS = ("#", "stitched", "kernels", "scheme", "rows x cols", "est us", "xla us", "ops")
_MIN_OPS_WIDTH = 24


def _table(regions) -> list[str]:
    """A row of numbers for each region, its mapping, reason and the mappings it tried below it."""
    if not regions:
        return []
    rows = [(r.name, "yes" if r.stitched else "no", str(r.kernels), r.scheme or "-",
             f"{r.rows}x{r.cols}" if r.rows else "-",
             f"{r.est_us:.1f}" if r.est_us is not None else "-",
             f"{r.xla_est_us:.1f}" if r.xla_est_us is not None else "-") for r in regions]
    widths = [max([len(c)] + [len(row[i]) for row in rows]) for i, c in enumerate(_COLUMNS[:-1])]
    ops_width = max(_MIN_OPS_WIDTH, WIDTH - sum(widths) - 2 * len(widths))
    right = {5, 6}  # numbers align right

    def line(cells):
        return "  ".join(v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(cells, widths)))

    lines = [line(_COLUMNS[:-1]) + "  ops"]
    for r, row in zip(regions, rows):
        lines.append((line(row) + "  " + key_ops(r.ops, ops_width)).rstrip())
        if r.mapping or r.variants:
            lines += _wrapped("mapping: " + "; ".join([r.mapping or "-", *r.variants]), "    ", "        ")
        if r.reason:
            lines += _wrapped("reason: " + r.reason, "    ", "        ")
            if r.source:
                lines += _wrapped("at: " + r.source, "    ", "        ")
        for alt in r.alternatives:
            lines += _wrapped("tried: " + alt, "    ", "        ")
    return lines


def key_ops(ops: tuple[str, ...], width: int = WIDTH) -> str:
    """'38: reduce_sum x4, reduce_max, mul x12, sub x4, +6 more': the op count, then its kinds, the
    reductions first, each kind by its count, as many as `width` holds."""
    n: dict[str, int] = {}
    for p in ops:
        n[p] = n.get(p, 0) + 1
    kinds = sorted(n, key=lambda p: (not (p in REDUCTIONS or p in SCANS or p.startswith("reduce")), -n[p], p))
    text = f"{len(ops)}:"
    for k, p in enumerate(kinds):
        item = (" " if k == 0 else ", ") + p + (f" x{n[p]}" if n[p] > 1 else "")
        left = len(kinds) - k - 1
        if k and len(text) + len(item) + (len(f", +{left} more") if left else 0) > width:
            return text + f", +{len(kinds) - k} more"
        text += item
    return text


_KEEP = "\x00"  # a space no line breaks at ("gather x5")


def _wrapped(text: str, first: str, rest: str) -> list[str]:
    lines = textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=rest, break_long_words=False,
                          break_on_hyphens=False) or [first.rstrip()]
    return [ln.replace(_KEEP, " ") for ln in lines]


_WRITTEN_OUT = {"random_bits": "threefry's integer ops: prng.py",
                "scatter-add": "into a fill, one value a row or one window, as a select: row_scatter.py",
                "scatter-add in float32": "half precision into a fill, added in float32, rounded once: "
                                          "wide_scatter.py",
                "matrix products merged": "into products of concatenations their producers write: "
                                          "merged_products.py",
                "transposed products folded": "the product written with its operands swapped: "
                                              "transposed_products.py",
                "conversions to bfloat16 unrounded": "only arithmetic reads them, as XLA's excess "
                                                     "precision: wide_converts.py",
                "floating conversion chains collapsed": "x.astype(bf16).astype(f32) is x, as XLA "
                                                        "computes it: fp_conversions.py",
                "products with a converted predicate as selects": "x * convert(p) is select(p, x, 0), as "
                                                                  "XLA computes it: predicate_products.py"}


def _source(program: Program, where: str, c) -> str:
    """The user's line behind the op a region's reason names (top-level regions, whose ops index the
    program's own trace), or ""."""
    index = c.plan.reason_op
    if where or index is None or c.reason != c.plan.reason or index >= len(program.traced.eqns):
        return ""
    return trace_mod.source_line(program.traced.eqns[index])


def _reason_kind(c) -> str | None:
    """The kind of the planner's reason, where that is the reason shown (not a compile error's)."""
    kind = c.plan.reason_kind
    return str(kind) if kind is not None and c.plan.reason else None


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
                      + tuple(f"below {n} rows: {v.plan.kernel.description}" for n, v in c.variants)),
            source=_source(program, where, c), reason_kind=_reason_kind(c)))
    seen, rewritten = {}, {}  # (primitive, why) -> equations
    for p in _programs(program):
        ops = p.traced.graph.ops
        for idx, why in p.partition.unsupported:
            pair = (ops[idx].prim, why)
            seen[pair] = seen.get(pair, 0) + 1
        for prim, n in p.traced.rewritten:
            rewritten[prim] = rewritten.get(prim, 0) + n
    return Report(program.target.name, tuple(regions), tuple(seen), cache, symbolic, seconds,
                  tuple(sorted(rewritten.items())), xla_counts=tuple(seen.values()), times=program.times)


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
