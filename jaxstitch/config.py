"""Every environment variable jaxstitch reads, read here and nowhere else."""
from __future__ import annotations

import dataclasses
import os

from .plan.mapping import Tuning


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
