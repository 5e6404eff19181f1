"""Every environment variable jaxstitch reads, read here and nowhere else."""
from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Config:
    disabled: bool          # JAXSTITCH_DISABLE=1: jaxstitch.jit is plain jax.jit
    dump_dir: str | None    # JAXSTITCH_DUMP_DIR: write each region's .cu, plan and report there
    cache_dir: str          # JAXSTITCH_CACHE_DIR: compiled cubins (default: the user cache directory)
    poison: bool            # JAXSTITCH_POISON=1: fill kernel outputs with NaN bytes before each launch
    max_threads_per_row: int  # JAXSTITCH_MAX_THREADS_PER_ROW: cap on the thread mapping (tuning; 1024)


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
        max_threads_per_row=_max_tpr(env.get("JAXSTITCH_MAX_THREADS_PER_ROW")),
    )


def _max_tpr(value: str | None) -> int:
    if not value:
        return 1024
    n = int(value)
    if n < 1 or n > 1024 or n & (n - 1):
        raise ValueError(f"JAXSTITCH_MAX_THREADS_PER_ROW={value!r}: must be a power of two from 1 to 1024")
    return n
