"""Every environment variable jaxstitch reads, read here and nowhere else, and the thread-mapping
overrides (`Tuning`) that JAXSTITCH_TUNE sets, which every stage from planning on reads."""
from __future__ import annotations

import dataclasses
import os

MIN_THREADS_PER_SM = 768  # registers are capped (launch bounds) so that this many threads fit an SM


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Overrides of the mapping heuristics (`JAXSTITCH_TUNE`), for measuring alternatives on a GPU.

    None keeps the heuristic. `elems`: elements of a row per thread and live array (a power of two);
    `min_threads`: threads per SM the launch bounds leave registers for; `stages`: 0 to 4 async
    staging buffers for rows that fit in registers; `min_gain_pct`: the estimated speedup (in %) the
    cost model asks for before it stitches (e.g. 100 to measure regions it declines); `splits`:
    blocks per long row when there are too few rows to fill the GPU (unset or 0: chosen by the
    planner; 1: never split); `online`: 0 reduces a softmax's max and sum of exponentials in two
    passes, as written, instead of one (plan/online.py); `shifts`: 0 leaves row-constant shifts
    inside the reductions (plan/shifts.py); `factors`: 0 leaves row-constant factors inside sums of
    exponentials (plan/shifts.py: a softmax backward's sum(dy * y) then keeps its own pass), 1 takes
    them out where rows are walked in chunks or split over blocks, 2 also where a row is held in
    registers; `fast_exp`: 0 computes exp with expf and erfc with erfcf even in half-precision
    regions (see planner.fast_exp).
    For ablations: `stitch`: 0 ends regions where XLA ends its kernels (at every use of a reduced
    value; siblings not merged); `grid`: 0 gives column and whole-array reductions kernels of their
    own (no grid barrier next to row work); `remote`: 0 launches independent regions separately;
    `recompute`: 0 reads every input a region's neighbours write, never recomputing cheap producers
    (recompute.py), 1 recomputes them where that reads fewer bytes, 2 also counts the write of an
    input no one else reads and takes in chains sharing a leaf together, 3 (the default) also
    trades a leaf no kernel writes for the written value one chain before it, and stops writing a
    value rebuilt from written values and positions (GPT's attention forward: the scaled scores
    and the float32 exponentials); `variants`: 0
    gives a shape family's long rows no split-row kernels for few rows (families.py's ladder);
    `split_rows`: the rows a forced split's stash is sized for, where a family's variant runs (its
    samples have more); `diamonds`: 0 has the cost model take every row reduction for fused by XLA
    with the ops reading it back (plan/diamonds.py); `scans`: 0 leaves every `lax.scan` an XLA loop
    (its body planned on its own) instead of one persistent kernel where that is planned to win
    (plan/scan.py); `scan_sums`: 0 has a persistent scan compute a product it adds to a
    sum-over-rows carry into an array of its own, then transpose, add and copy it, as written
    (plan/scan.py's InPlaceSum); `pairs`: 0 reads a rotary embedding's other half through gathers,
    with both halves' formulas at every element, instead of from the registers of a paired mapping
    (plan/pairs.py); `serpentine`: 0 walks a row's chunks in the same order in every pass (see
    Mapping.serpentine); `scatters`: 0 keeps a scatter-add of one value per row into a fill
    (take_along_axis's gradient: optax's integer-label cross-entropy) a scatter, a region boundary,
    instead of the select it is (row_scatter.py); `wide_scatters`: 0 keeps a half-precision
    scatter-add into a fill (an embedding's gradient) XLA's, added and rounded in the half type
    update by update, instead of adding in float32 and rounding once (wide_scatter.py);
    `merge_products`: 1 (the default) writes matrix products that share an operand, or whose
    results are summed, as one product over concatenations their producers write, and in such a
    program folds transposes of products into them (merged_products.py, transposed_products.py;
    GPT bfloat16, H100: 12.19 -> 11.64 ms busy); 0 keeps them as written;
    `batched_folds`: folds batched products' transposes of the minor axis into them
    (batched_products.py): 1 (the default) those an op computing with the result reads, 2 every
    one, 0 none; `product_concats`: 1 counts every concatenation only products read as one XLA
    copies (merged_products.mark_product_concatenations);
    `cut_saving_us`: the estimated saving (in µs) a region cut from an unplannable neighbour needs
    before it is stitched (planner.CUT_MIN_SAVING_US; a large value leaves every such region to
    XLA); `cmd_buffers`: 0 launches our kernels between XLA's command buffers
    (CUDA graphs) instead of letting XLA trace them into one (integration/ffi.py TARGET_PLAIN): in one
    process slower for BERT in both dtypes and for GPT, faster within noise for DIEN,
    so 1 stays the default; `xla_kernels`: 1 hands kernels the launcher is not needed for to XLA's
    own kernel call as PTX (kernels/xla_kernel.py), which XLA records into its graphs as kernel
    nodes; 0 (the default: no gain measured on BERT's or GPT's step) launches every
    kernel through the launcher; `col_group`: columns a block finishes together after a grid
    barrier (0, the default: the fewest that leave a group to nearly every block, planner.column_group);
    `one_wave`: 1 launches a grid-stride row kernel with
    as many blocks as its cubin lets reside at once (mapping.one_wave), where its registers leave
    fewer blocks an SM than the plan's grid assumed (8 of 256): GPT's attention softmax, 73
    registers, runs 1056 blocks in 2.67 waves of 396; 0 (the default: no gain on GPT's or BERT's
    bfloat16 step, H100) keeps the plan's grid; `wide_converts`: 1 computes on a
    conversion to bfloat16 unrounded where only arithmetic reads it (wide_converts.py), and has a
    backward read a softmax's float32 sum (recompute._unrounds); 0 (the default) rounds every one,
    as the jaxpr says: 1 moved an attention block's bfloat16 gradients a little nearer float32 but
    rounded less than XLA does on Hopper, whose bfloat16 max, sub and exp are native (a DIEN-like
    tile kernel then ended 8% of its largest value from jax.jit's; H100); `prefixes`: 0
    has stage copies read whole rows even where a causal mask reads only a prefix of each
    (plan/prefixes.py); `teams`: tiles a tile kernel's block works on at once, one a warp (1: the
    block on one tile; plan/tile.TILE_TEAMS by default)."""

    max_tpr: int = 1024
    elems: int | None = None
    min_threads: int = MIN_THREADS_PER_SM
    stages: int | None = None
    min_gain_pct: int | None = None
    splits: int | None = None
    online: int = 1
    shifts: int = 1
    factors: int = 1
    fast_exp: int = 1
    stitch: int = 1
    grid: int = 1
    remote: int = 1
    recompute: int = 3
    variants: int = 1
    split_rows: int | None = None
    diamonds: int = 1
    scans: int = 1
    scan_sums: int = 1
    pairs: int = 1
    serpentine: int = 1
    scatters: int = 1
    wide_scatters: int = 1
    merge_products: int = 1
    batched_folds: int = 1
    product_concats: int = 0
    cut_saving_us: int | None = None
    cmd_buffers: int = 1
    xla_kernels: int = 0
    col_group: int = 0
    one_wave: int = 0
    wide_converts: int = 0
    prefixes: int = 1
    teams: int | None = None

    FIELDS = ("max_tpr", "elems", "min_threads", "stages", "min_gain_pct", "splits", "online", "shifts", "factors", "fast_exp",
              "stitch", "grid", "remote", "recompute", "variants", "split_rows", "diamonds", "scans",
              "scan_sums", "pairs", "serpentine", "scatters", "wide_scatters", "merge_products",
              "batched_folds", "product_concats", "cut_saving_us", "cmd_buffers", "xla_kernels", "col_group",
              "one_wave", "wide_converts", "prefixes", "teams")

    @classmethod
    def parse(cls, spec: str) -> "Tuning":
        """`"max_tpr=128,elems=16"` -> Tuning; raises ValueError naming the bad item."""
        values = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            name, _, value = item.partition("=")
            if name not in cls.FIELDS or not value.strip().isdigit():
                raise ValueError(f"{item!r}: expected NAME=INTEGER with NAME one of {', '.join(cls.FIELDS)}")
            values[name] = int(value)
        t = cls(**values)
        for name in ("max_tpr", "elems"):
            n = getattr(t, name)
            if n is not None and (n < 1 or n > 1024 or n & (n - 1)):
                raise ValueError(f"{name}={n}: must be a power of two from 1 to 1024")
        if t.stages not in (None, 0, 1, 2, 3, 4):
            raise ValueError(f"stages={t.stages}: must be from 0 to 4")
        if t.batched_folds not in (0, 1, 2):
            raise ValueError(f"batched_folds={t.batched_folds}: must be 0 (none), 1 (those an op computes with) or 2 (every one)")
        for name in ("one_wave", "wide_converts", "prefixes"):
            if getattr(t, name) not in (0, 1):
                raise ValueError(f"{name}={getattr(t, name)}: must be 0 or 1")
        if t.teams not in (None, 1, 2, 4, 8):
            raise ValueError(f"teams={t.teams}: must be 1, 2, 4 or 8")
        if t.col_group not in (0, 1, 2, 4, 8, 16, 32):
            raise ValueError(f"col_group={t.col_group}: must be 0 (chosen by the shape) or a power of two up to 32")
        if not 32 <= t.min_threads <= 2048:
            raise ValueError(f"min_threads={t.min_threads}: must be from 32 to 2048")
        return t


@dataclasses.dataclass(frozen=True)
class Config:
    disabled: bool          # JAXSTITCH_DISABLE=1: jaxstitch.jit is plain jax.jit
    dump_dir: str | None    # JAXSTITCH_DUMP_DIR: write each region's .cu, plan and report there
    cache_dir: str          # JAXSTITCH_CACHE_DIR: compiled cubins (default: the user cache directory)
    poison: bool            # JAXSTITCH_POISON=1: fill kernel outputs with NaN bytes before each launch
    tuning: Tuning          # JAXSTITCH_TUNE="max_tpr=128,elems=16,...": mapping overrides (experiments)
    # JAXSTITCH_STRICT=1: an internal error in planning, code generation or NVRTC raises instead of
    # leaving its region to XLA with a warning (the test suite runs with it on)
    strict: bool = False
    # XLA_FLAGS' --xla_allow_excess_precision (XLA's default: true): XLA then collapses chains of
    # floating conversions, and so does the trace (fp_conversions.py), for our kernels to agree
    excess_precision: bool = True
    # JAXSTITCH_CACHE_MAX_MB: the disk cache's bound in MB (default 1024; 0: unbounded); a write past
    # it evicts the entries used least recently
    cache_max_bytes: int = 1 << 30
    # JAXSTITCH_OVERRIDE_DIR: hand-edited kernels, `<hash>.cu` compiled in place of the generated
    # source of that hash (the dump's region*.plan.txt names it; dumps.py)
    override_dir: str | None = None
    # JAXSTITCH_PROGRESS=0: no progress line on stderr for builds longer than a few seconds
    progress: bool = True
    # JAXSTITCH_GUARD=0/1: the program guard off, or on even without a GPU (guard.py); unset: on
    # where the kernels run on a GPU. `jaxstitch.jit(..., guard=)` decides before it.
    guard: bool | None = None
    # JAXSTITCH_NVRTC_SECONDS: NVRTC is cancelled on a kernel after this long (at its next phase) and
    # its region left to XLA (default 30; 0: no limit). BERT's stitched kernels take at most 1 s each;
    # the one kernel seen past 30 s took 90 s, and ptxas then found it spilling.
    nvrtc_seconds: float = 30.0


def _flag(value: str | None) -> bool:
    return (value or "0").lower() not in ("", "0", "false", "no", "off")


def load() -> Config:
    env = os.environ
    default_cache = os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxstitch")
    return Config(
        disabled=_flag(env.get("JAXSTITCH_DISABLE")),
        dump_dir=env.get("JAXSTITCH_DUMP_DIR") or None,
        cache_dir=env.get("JAXSTITCH_CACHE_DIR") or default_cache,
        poison=_flag(env.get("JAXSTITCH_POISON")),
        tuning=_tuning(env.get("JAXSTITCH_TUNE", "")),
        strict=_flag(env.get("JAXSTITCH_STRICT")),
        excess_precision=_xla_flag(env.get("XLA_FLAGS", ""), "xla_allow_excess_precision", True),
        cache_max_bytes=_megabytes("JAXSTITCH_CACHE_MAX_MB", env.get("JAXSTITCH_CACHE_MAX_MB"), 1024),
        override_dir=env.get("JAXSTITCH_OVERRIDE_DIR") or None,
        progress=_flag(env.get("JAXSTITCH_PROGRESS", "1")),
        guard=None if env.get("JAXSTITCH_GUARD", "") == "" else _flag(env.get("JAXSTITCH_GUARD")),
        nvrtc_seconds=_seconds("JAXSTITCH_NVRTC_SECONDS", env.get("JAXSTITCH_NVRTC_SECONDS"), 30.0),
    )


def _xla_flag(flags: str, name: str, default: bool) -> bool:
    """A boolean XLA flag's value in an XLA_FLAGS string (`--name`, `--name=false`), else `default`."""
    value = default
    for word in flags.split():
        key, _, val = word.lstrip("-").partition("=")
        if key == name:
            value = _flag(val or "true")
    return value


def _seconds(name: str, value: str | None, default: float) -> float:
    """A duration in seconds, at least 0; `default` where unset."""
    try:
        seconds = float(value) if value not in (None, "") else default
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a number of seconds (0: no limit)") from None
    if not seconds >= 0:
        raise ValueError(f"{name}={value!r}: expected a number of seconds at least 0 (0: no limit)")
    return seconds


def _megabytes(name: str, value: str | None, default: int) -> int:
    """A size in MB (decimal allowed) as bytes; `default` MB where unset."""
    try:
        mb = float(value) if value not in (None, "") else default
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a number of MB (0: unbounded)") from None
    if not 0 <= mb < float("inf"):
        raise ValueError(f"{name}={value!r}: expected a number of MB (0: unbounded)")
    return int(mb * (1 << 20))


def _tuning(spec: str) -> Tuning:
    try:
        return Tuning.parse(spec)
    except ValueError as e:
        raise ValueError(f"JAXSTITCH_TUNE={spec!r}: {e}") from None
