"""Every environment variable jaxstitch reads, read here and nowhere else, and the thread-mapping
overrides (`Tuning`) that JAXSTITCH_TUNE sets, which every stage from planning on reads."""
from __future__ import annotations

import dataclasses
import os

MIN_THREADS_PER_SM = 768  # registers are capped (launch bounds) so that this many threads fit an SM


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Overrides of the planner's heuristics, and switches for its techniques (`JAXSTITCH_TUNE`), for
    measuring alternatives on a GPU: every knob in one line, by stage, in docs/usage.md (Planner
    experiments). None keeps the heuristic; for a switch, 1 is the technique on and 0 off. Where a
    default was decided by measurement, the field's comment says by what."""

    # frontend: the trace's rewrites
    scatters: int = 1
    wide_scatters: int = 1
    merge_products: int = 1  # GPT bfloat16, H100: 12.19 -> 11.64 ms busy
    batched_folds: int = 1
    product_concats: int = 0

    # graph: which ops share a region
    stitch: int = 1
    tails: int = 1
    recompute: int = 3  # 3: GPT's attention forward stops writing its scaled scores and float32 exponentials
    wide_converts: int = 0  # 1 rounds less than XLA on Hopper: a DIEN-like tile kernel ended 8% off jax.jit's

    # plan: each region's kernel (layout, thread mapping, cost)
    min_gain_pct: int | None = None
    cut_saving_us: int | None = None
    max_tpr: int = 1024
    elems: int | None = None
    min_threads: int = MIN_THREADS_PER_SM
    stages: int | None = None
    splits: int | None = None
    split_rows: int | None = None
    online: int = 1
    shifts: int = 1
    factors: int = 1
    fast_exp: int = 1
    grid: int = 1
    remote: int = 1
    diamonds: int = 1
    scans: int = 1
    scan_sums: int = 1
    pairs: int = 1
    serpentine: int = 1
    prefixes: int = 1
    teams: int | None = None
    col_group: int = 0
    one_wave: int = 0  # 1 gained nothing on GPT's or BERT's bfloat16 step (H100)
    variants: int = 1

    # integration: how the kernels run in XLA's program
    cmd_buffers: int = 1  # 0 was slower in one process for BERT (both dtypes) and GPT, a tie for DIEN
    xla_kernels: int = 0  # 1 gained nothing on BERT's or GPT's step

    FIELDS = ("scatters", "wide_scatters", "merge_products", "batched_folds", "product_concats",
              "stitch", "tails", "recompute", "wide_converts", "min_gain_pct", "cut_saving_us",
              "max_tpr", "elems", "min_threads", "stages", "splits", "split_rows", "online",
              "shifts", "factors", "fast_exp", "grid", "remote", "diamonds", "scans", "scan_sums",
              "pairs", "serpentine", "prefixes", "teams", "col_group", "one_wave", "variants",
              "cmd_buffers", "xla_kernels")  # (in the order of the fields)

    @classmethod
    def parse(cls, spec: str) -> "Tuning":
        """`"max_tpr=128,elems=16"` -> Tuning; raises ValueError naming the bad item."""
        values = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            name, _, value = item.partition("=")
            if name not in cls.FIELDS or not value.strip().isdigit():
                raise ValueError(f"{item!r}: expected NAME=INTEGER with NAME one of {', '.join(cls.FIELDS)}")
            values[name] = int(value)
        return cls(**values).checked()

    def checked(self) -> "Tuning":
        """This Tuning, if every knob is in its range; else ValueError naming the knob. (Planning's own
        variations of a Tuning, such as halving `elems`, are not checked.)"""
        t = self
        for name in ("max_tpr", "elems"):
            n = getattr(t, name)
            if n is not None and (n < 1 or n > 1024 or n & (n - 1)):
                raise ValueError(f"{name}={n}: must be a power of two from 1 to 1024")
        if t.stages not in (None, 0, 1, 2, 3, 4):
            raise ValueError(f"stages={t.stages}: must be from 0 to 4")
        if t.batched_folds not in (0, 1, 2):
            raise ValueError(f"batched_folds={t.batched_folds}: must be 0 (none), 1 (those an op computes with) or 2 (every one)")
        for name in ("one_wave", "wide_converts", "prefixes", "tails"):
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


def _number(name: str, value: str | None, default: float, expected: str) -> float:
    """`value` as a float, `default` where unset; else ValueError naming the variable and `expected`."""
    try:
        return float(value) if value not in (None, "") else default
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected {expected}") from None


def _seconds(name: str, value: str | None, default: float) -> float:
    """A duration in seconds, at least 0; `default` where unset."""
    seconds = _number(name, value, default, "a number of seconds (0: no limit)")
    if not seconds >= 0:
        raise ValueError(f"{name}={value!r}: expected a number of seconds at least 0 (0: no limit)")
    return seconds


def _megabytes(name: str, value: str | None, default: int) -> int:
    """A size in MB (decimal allowed) as bytes; `default` MB where unset."""
    mb = _number(name, value, default, "a number of MB (0: unbounded)")
    if not 0 <= mb < float("inf"):
        raise ValueError(f"{name}={value!r}: expected a number of MB (0: unbounded)")
    return int(mb * (1 << 20))


def _tuning(spec: str) -> Tuning:
    try:
        return Tuning.parse(spec)
    except ValueError as e:
        raise ValueError(f"JAXSTITCH_TUNE={spec!r}: {e}") from None
