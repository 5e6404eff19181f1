"""The kernel cache: compiled cubins in this process's memory and on disk (JAXSTITCH_CACHE_DIR, at
most JAXSTITCH_CACHE_MAX_MB; kernels/cache.py).

    jaxstitch.cache.clear()      # memory and disk: the next build compiles every kernel again
    jaxstitch.cache.stats()      # NVRTC compiles, memory and disk hits of this process so far
    jaxstitch.cache.directory()  # where the disk cache lives
"""
from __future__ import annotations

from .core import config
from .kernels import cache as _cache
from .kernels.cache import Stats, stats  # noqa: F401

__all__ = ["Stats", "clear", "directory", "stats"]


def directory() -> str:
    """The disk cache's directory: JAXSTITCH_CACHE_DIR, else the user cache directory's jaxstitch/."""
    return config.load().cache_dir


def clear(disk: bool = True) -> int:
    """Empties the cache in memory and, with `disk`, on disk (kernels already loaded keep running);
    returns the disk files removed. Only the cache's own files go: anything else there stays."""
    if not disk:
        _cache.clear_memory()
        return 0
    return _cache.clear(directory())
