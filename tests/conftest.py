"""Shared test setup.

* Tests marked `@pytest.mark.gpu` (the marker is declared in pyproject.toml) are skipped, with the reason
  "needs an NVIDIA GPU", when `jax.devices()` holds no GPU.
* The CPU backend shows four devices (`--xla_force_host_platform_device_count=4`, set before JAX
  starts), so the sharding tests (test_spmd.py) run their mesh on a CPU-only machine.
* `--part I/N` runs every N-th selected test from the I-th (after `-m`): the GPU tests outgrew one
  call of the device runner (10 minutes), so `scripts/gpu_check.sh` can run them in parts.
* The whole session uses a fresh temporary JAXSTITCH_CACHE_DIR, so tests never read or write the user's
  kernel cache; JAXSTITCH_DISABLE and JAXSTITCH_DUMP_DIR from the caller's environment are cleared (tests
  that want them set them with monkeypatch).
* Under pytest-xdist (`-n 2`, the README's command) each worker allocates GPU memory as it goes
  (XLA_PYTHON_CLIENT_PREALLOCATE=false): two processes that each took XLA's default 75% would not fit.
* JAXSTITCH_GUARD=0: the tests check our kernels, which the program guard would replace by
  jax.jit's program where it measured them slower (tests/test_guard.py turns it on).
* JAXSTITCH_STRICT=1: an internal error in planning, code generation or NVRTC raises (a user gets the
  region left to XLA with a warning), so that such bugs fail the tests.
"""
from __future__ import annotations

import functools
import os
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:  # `import strategies` from the test modules
    sys.path.insert(0, TESTS_DIR)

HOST_DEVICES = "--xla_force_host_platform_device_count=4"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + HOST_DEVICES).strip()

os.environ["JAXSTITCH_GUARD"] = "0"  # (before any test module's jaxstitch.jit reads it)

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

GPU_SKIP_REASON = "needs an NVIDIA GPU"
_ENV_CLEARED = ("JAXSTITCH_DISABLE", "JAXSTITCH_DUMP_DIR")


@functools.lru_cache(maxsize=1)
def _has_gpu() -> bool:
    import jax

    try:
        return any(d.platform in ("gpu", "cuda") for d in jax.devices())
    except RuntimeError:
        return False


@pytest.fixture(scope="session")
def gpu_available() -> bool:
    """True when jax sees an NVIDIA GPU."""
    return _has_gpu()


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None and not _has_gpu():
        pytest.skip(GPU_SKIP_REASON)


@pytest.fixture(scope="session", autouse=True)
def _jaxstitch_session_env(tmp_path_factory):
    """A private kernel cache for the session; no inherited disable / dump switches; strict errors."""
    saved = {k: os.environ.get(k) for k in ("JAXSTITCH_CACHE_DIR", "JAXSTITCH_STRICT") + _ENV_CLEARED}
    cache_dir = tmp_path_factory.mktemp("jaxstitch_cache")
    os.environ["JAXSTITCH_CACHE_DIR"] = str(cache_dir)
    os.environ["JAXSTITCH_STRICT"] = "1"
    for k in _ENV_CLEARED:
        os.environ.pop(k, None)
    yield cache_dir
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def pytest_addoption(parser):
    parser.addoption("--part", default="", metavar="I/N",
                     help="run every N-th selected test, from the I-th (1-based)")


def _part(spec: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--part {spec!r}: expected I/N, e.g. 1/2") from None
    if not 1 <= i <= n:
        raise pytest.UsageError(f"--part {spec!r}: I must be from 1 to N")
    return i, n


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs
def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--part")
    if not spec:
        return
    i, n = _part(spec)
    keep = [it for k, it in enumerate(items) if k % n == i - 1]
    config.hook.pytest_deselected(items=[it for k, it in enumerate(items) if k % n != i - 1])
    items[:] = keep
