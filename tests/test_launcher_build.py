"""CPU checks of the FFI launcher: the extension is built and exports its
handlers, registration never fails, and the custom call lowers to StableHLO
that carries only data (the cubin bytes, not a pointer)."""
import ctypes
import re

import jax
import jax.numpy as jnp
import pytest

from jaxstitch.integration import ffi

SO_PATH = ffi._find_library()
needs_so = pytest.mark.skipif(
    SO_PATH is None,
    reason="jaxstitch/kernels/_launcher*.so is not built "
    "(run `pip install --no-build-isolation --no-deps -e .`)")


@needs_so
def test_extension_exports_its_handlers():
    lib = ctypes.cdll.LoadLibrary(SO_PATH)
    for name in ("JaxstitchLaunchExecute", "JaxstitchLaunchExecutePlain", "JaxstitchLaunchInitialize"):
        assert getattr(lib, name) is not None


@needs_so
def test_register_is_idempotent_and_does_not_need_a_gpu():
    # Without a CUDA backend jax queues the registration for platform CUDA
    # instead of failing, so this holds on CPU-only machines too.
    assert ffi.register() == (True, None)
    assert ffi.register() == (True, None)


def test_register_reports_a_missing_extension(monkeypatch):
    monkeypatch.setattr(ffi, "_result", None)
    monkeypatch.setattr(ffi, "_find_library", lambda: None)
    ok, reason = ffi.register()
    assert not ok and "_launcher" in reason
    monkeypatch.setattr(ffi, "_result", None)  # let later calls retry


def _fn(x):
    out = ffi.launch(
        [x], out_types=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
        cubin=b"\x00\x01", key="abc", kernel="k", grid=1, block=32, smem=0,
        cooperative=False)
    return out[0]


def _check_hlo(text):
    assert "custom_call @jaxstitch_launch" in text
    for attr in ("block = 32 : i64", "cooperative = 0 : i64", "grid = 1 : i64",
                 'kernel = "k"', 'key = "abc"', "smem = 0 : i64",
                 "cubin = dense<[0, 1]> : tensor<2xui8>"):
        assert attr in text, attr
    # Nothing that looks like a process-local pointer travels in the HLO.
    assert not re.search(r"0x[0-9a-fA-F]{8,}", text)
    assert not re.search(r"\d{10,}", text)


def test_lowering_for_cpu_carries_the_attributes():
    # Lowering does not look the target up; only compiling would (and fail on
    # CPU, where the target is not registered).
    spec = jax.ShapeDtypeStruct((4,), jnp.float32)
    _check_hlo(jax.jit(_fn).lower(spec).as_text())


def test_lowering_for_cuda_from_a_cpu_machine():
    spec = jax.ShapeDtypeStruct((4,), jnp.float32)
    lowered = jax.jit(_fn).trace(spec).lower(lowering_platforms=("cuda",))
    _check_hlo(lowered.as_text())


@pytest.mark.parametrize("spec,target", [("", ffi.TARGET), ("cmd_buffers=0", ffi.TARGET_PLAIN)])
def test_a_program_picks_the_command_buffer_registration(monkeypatch, spec, target):
    """Our launches go to the handler XLA may trace into its command buffers, or with
    JAXSTITCH_TUNE=cmd_buffers=0 to the same handler registered without that trait (launched
    between them): lowered for CUDA from this CPU machine, every launch names the one asked for."""
    import jaxstitch
    from jaxstitch.bench import workloads
    monkeypatch.setenv("JAXSTITCH_TUNE", spec)
    spec_ = jax.ShapeDtypeStruct((4096, 1024), jnp.float32)
    f = jaxstitch.jit(workloads.softmax_fwdbwd, target="h100")
    text = f.trace(spec_, spec_).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @(\w+)", text)
    assert calls and set(calls) == {target}, calls
