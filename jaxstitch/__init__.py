"""jaxstitch: AStitch-style stitching of memory-bound JAX regions into single CUDA kernels.

`jaxstitch.jit` works like `jax.jit`; `jaxstitch.explain` says what it stitched and why not.
"""
import logging as _logging

from .api import disabled_checks, explain, jit  # noqa: F401
from .kernels import ffi as _ffi
from .families import build_stats  # noqa: F401
from .kernels.cache import stats as cache_stats  # noqa: F401
from . import cache  # noqa: F401  (jaxstitch.cache.clear(), .stats(), .directory())
from . import transforms as _transforms  # noqa: F401  (the stitch primitive's grad / vmap rules)
from .spmd import lowering as _spmd_lowering  # noqa: F401  (its lowering over several devices)
from .targets import TARGETS, Target, get_target  # noqa: F401
from . import jax_internals as _jax_internals

__version__ = "0.1.0"
_logging.getLogger("jaxstitch").addHandler(_logging.NullHandler())

_jax_internals.hide_frames()  # tracebacks through jaxstitch.jit show the user's frames, not ours
_ffi.register()  # the custom-call target exists as soon as jaxstitch is imported (for jax.export)
