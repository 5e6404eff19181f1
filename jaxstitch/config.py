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
    )


def _tuning(spec: str) -> Tuning:
    try:
        return Tuning.parse(spec)
    except ValueError as e:
        raise ValueError(f"JAXSTITCH_TUNE={spec!r}: {e}") from None
