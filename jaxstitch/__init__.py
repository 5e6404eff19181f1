"""jaxstitch: AStitch-style stitching of memory-bound JAX regions into single CUDA kernels.

`jaxstitch.jit` works like `jax.jit`; `jaxstitch.explain` says what it stitched and why not.

The package runs in pipeline order, each folder importing only those before it:
core -> frontend -> graph -> plan -> lowering -> kernels -> driver -> integration, with the public
API (`api`, `nnx`, `cache`, `targets`) on top and the benchmarks (`bench/`) beside it.
"""
import logging as _logging

from . import cache  # noqa: F401  (jaxstitch.cache.clear(), .stats(), .directory())
from . import targets  # noqa: F401  (jaxstitch.targets.detect(), .get_target(), .TARGETS)
from .api import disabled_checks, explain, jit  # noqa: F401
from .integration import ffi as _ffi
from .integration import jax_internals as _jax_internals
from .integration import transforms as _transforms  # noqa: F401  (the stitch primitive's grad / vmap rules)
from .integration.families import build_stats  # noqa: F401
from .integration.spmd import lowering as _spmd_lowering  # noqa: F401  (its lowering over several devices)
from .integration.xla_compiles import compiles as xla_compiles  # noqa: F401  (XLA's compiles of our programs)
from .kernels.cache import stats as cache_stats  # noqa: F401
from .targets import TARGETS, Target, get_target  # noqa: F401

__version__ = "0.1.0"
_logging.getLogger("jaxstitch").addHandler(_logging.NullHandler())

_jax_internals.hide_frames()  # tracebacks through jaxstitch.jit show the user's frames, not ours
_ffi.register()  # the custom-call target exists as soon as jaxstitch is imported (for jax.export)
