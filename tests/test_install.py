"""CPU checks of how jaxstitch installs and says what it lacks: the packages setup.py ships are every
package under jaxstitch/, the CUDA extras name what integration/availability.py recommends, and each
missing piece (a CUDA jaxlib on a GPU machine, the launcher, NVRTC) is one warning a process with the
command that fixes it. The machine's state is monkeypatched, so these fail here if the checks break."""
import logging
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jaxstitch
from jaxstitch import targets
from jaxstitch.integration import availability, devices
from jaxstitch.kernels import nvrtc

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _package_dirs() -> set[str]:
    return {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "jaxstitch").rglob("__init__.py")}


def test_setup_ships_every_package_under_jaxstitch(monkeypatch):
    pytest.importorskip("setuptools")  # (which provides distutils from Python 3.12 on)
    from distutils.core import run_setup

    monkeypatch.chdir(ROOT)
    dist = run_setup("setup.py", stop_after="config")
    assert set(dist.packages) == _package_dirs() | {"jaxstitch.csrc_templates"}
    assert {"jaxstitch.integration.spmd", "jaxstitch.kernels", "jaxstitch.plan"} <= set(dist.packages)
    assert dist.package_dir["jaxstitch.csrc_templates"] == "csrc_templates"
    assert set(dist.package_data["jaxstitch.csrc_templates"]) >= {"*.cu", "*.cuh"}


def test_every_directory_of_python_files_is_a_package():
    """find_packages skips a directory without __init__.py: its modules would be left out of a wheel."""
    dirs = {p.parent for p in (ROOT / "jaxstitch").rglob("*.py") if "__pycache__" not in p.parts}
    assert [d for d in dirs if not (d / "__init__.py").exists()] == []


def test_the_cuda_extras_are_what_the_warnings_recommend():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for line, packages in availability.CUDA_LINES.items():
        assert tuple(extras[f"cuda{line}"]) == packages
    assert tuple(extras["cuda"]) == availability.CPU_PLANNING


def test_setup_reports_a_failed_launcher_build_and_goes_on(tmp_path):
    env = dict(os.environ, CC="false", CXX="false")
    run = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                          "--build-temp", str(tmp_path / "temp")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "the kernel launcher" in run.stderr and "was not built" in run.stderr
    assert "pip install --no-build-isolation" in run.stderr
    assert not list(tmp_path.rglob("_launcher*.so"))


@pytest.fixture
def machine(monkeypatch, caplog):
    """A machine whose GPU, jax backend, plugin and driver the test sets; fresh once-a-process state."""
    monkeypatch.setattr(availability, "_said", set())
    caplog.set_level(logging.INFO, logger="jaxstitch")
    state = dict(gpu=True, seen=None, plugin=None, driver=580)
    monkeypatch.setattr(availability, "nvidia_gpu_present", lambda: state["gpu"])
    monkeypatch.setattr(devices, "detect", lambda: state["seen"])
    monkeypatch.setattr(availability, "jax_cuda_plugin", lambda: state["plugin"])
    monkeypatch.setattr(availability, "driver_version", lambda: state["driver"])
    return state


def _said(caplog, level=logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "jaxstitch" and r.levelno == level]


def _runs_as_jax_jit(f):
    x = jnp.arange(4.0)
    assert jnp.allclose(f(x), jnp.sin(x) * 2)


def _fun(x):
    return jnp.sin(x) * 2


def test_a_cpu_only_jaxlib_on_a_gpu_machine_warns_once_with_the_pip_command(machine, caplog):
    for _ in range(3):
        _runs_as_jax_jit(jaxstitch.jit(_fun))
    said = _said(caplog)
    assert len(said) == 1, said
    assert "NVIDIA GPU (driver 580)" in said[0] and "CPU-only jaxlib" in said[0]
    assert "pip install 'jax[cuda13]>=0.7.2' 'cuda-bindings>=13,<14' 'nvidia-cuda-nvrtc>=13,<14'" in said[0]
    assert not _said(caplog, logging.INFO)


def test_an_older_driver_gets_the_cuda12_line(machine, caplog):
    machine["driver"] = 550
    jaxstitch.jit(_fun)
    (said,) = _said(caplog)
    assert "pip install 'jax[cuda12]>=0.6' 'cuda-bindings>=12.9,<13' 'nvidia-cuda-nvrtc-cu12>=12.1,<13'" in said


def test_an_installed_plugin_that_found_no_gpu_is_named(machine, caplog):
    machine["plugin"] = "jax-cuda12-plugin"
    jaxstitch.jit(_fun)
    (said,) = _said(caplog)
    assert "jax-cuda12-plugin is installed" in said and "no usable CUDA device" in said


def test_no_gpu_at_all_is_one_info_line_and_no_warning(machine, caplog):
    machine["gpu"] = False
    _runs_as_jax_jit(jaxstitch.jit(_fun))
    jaxstitch.jit(_fun)
    assert _said(caplog) == []
    assert _said(caplog, logging.INFO) == ["no CUDA GPU found; jaxstitch.jit is jax.jit here"]


def test_a_missing_launcher_warns_once_with_the_rebuild_command(machine, caplog, monkeypatch):
    machine["seen"] = targets.TARGETS["h100"]
    monkeypatch.setattr(availability.ffi, "register", lambda: (False, "the extension is not built"))
    for _ in range(2):
        _runs_as_jax_jit(jaxstitch.jit(_fun))
    (said,) = _said(caplog)
    assert "the extension is not built" in said and "C++17 compiler" in said
    assert "pip install --no-build-isolation --no-deps --force-reinstall" in said


def test_missing_nvrtc_warns_once_and_leaves_a_named_target_to_jax_jit(machine, caplog, monkeypatch):
    machine.update(gpu=False, driver=None)
    monkeypatch.setattr(nvrtc, "unavailable_reason",
                        lambda: f"NVRTC is not available: no libnvrtc; {nvrtc.INSTALL_HINT}")
    for _ in range(2):
        _runs_as_jax_jit(jaxstitch.jit(_fun, target="h100"))
    (said,) = _said(caplog)
    assert said.startswith("NVRTC is not available: no libnvrtc, so jaxstitch.jit runs as jax.jit")
    assert "pip install 'cuda-bindings>=13,<14' 'nvidia-cuda-nvrtc>=13,<14'" in said
    assert nvrtc.INSTALL_HINT not in said


def test_missing_nvrtc_on_a_gpu_names_the_jax_plugin_line(machine, caplog, monkeypatch):
    machine.update(seen=targets.TARGETS["h100"], plugin="jax-cuda12-plugin")
    monkeypatch.setattr(availability.ffi, "register", lambda: (True, None))
    monkeypatch.setattr(nvrtc, "unavailable_reason", lambda: "NVRTC is not available: no libnvrtc")
    assert availability.usable_target(None) is None
    (said,) = _said(caplog)
    assert "pip install 'cuda-bindings>=12.9,<13' 'nvidia-cuda-nvrtc-cu12>=12.1,<13'" in said


def test_everything_in_place_keeps_the_target(machine, caplog, monkeypatch):
    machine["seen"] = targets.TARGETS["h200"]
    monkeypatch.setattr(availability.ffi, "register", lambda: (True, None))
    monkeypatch.setattr(nvrtc, "unavailable_reason", lambda: None)
    assert availability.usable_target(None) is targets.TARGETS["h200"]
    assert availability.usable_target(targets.TARGETS["a100"]) is targets.TARGETS["a100"]
    assert caplog.records == []


def test_nvrtc_without_its_library_is_unavailable(monkeypatch):
    """cuda.bindings imports without libnvrtc and fails at the first call: that must read as missing."""
    bindings = pytest.importorskip("cuda.bindings.nvrtc")

    def no_library():
        raise RuntimeError('Failure finding "libnvrtc.so.13"')

    nvrtc._nvrtc.cache_clear()
    monkeypatch.setattr(bindings, "nvrtcVersion", no_library)
    try:
        assert not nvrtc.available()
        assert "libnvrtc.so.13" in nvrtc.unavailable_reason()
        with pytest.raises(nvrtc.CompileError, match="cuda13"):
            nvrtc.compile_ptx("extern \"C\" __global__ void k() {}", "sm_90")
    finally:
        monkeypatch.undo()
        nvrtc._nvrtc.cache_clear()


def test_a_gpu_is_found_from_files_alone(monkeypatch, tmp_path):
    monkeypatch.setattr(availability, "DEVICE_NODES", str(tmp_path / "nvidia[0-9]*"))
    monkeypatch.setattr(availability, "PROC_GPUS", str(tmp_path / "gpus"))
    monkeypatch.setattr(availability, "WSL_GPU", (str(tmp_path / "dxg"), str(tmp_path / "libcuda.so")))
    assert not availability.nvidia_gpu_present()
    (tmp_path / "dxg").touch()
    assert not availability.nvidia_gpu_present()  # (WSL2's bridge serves other vendors' GPUs too)
    (tmp_path / "libcuda.so").touch()
    assert availability.nvidia_gpu_present()
    (tmp_path / "libcuda.so").unlink()
    (tmp_path / "gpus" / "0000:01:00.0").mkdir(parents=True)
    assert availability.nvidia_gpu_present()
    (tmp_path / "gpus" / "0000:01:00.0").rmdir()
    assert not availability.nvidia_gpu_present()
    (tmp_path / "nvidia0").touch()
    assert availability.nvidia_gpu_present()


def test_the_driver_version_is_read_from_proc(monkeypatch, tmp_path):
    version = tmp_path / "version"
    monkeypatch.setattr(availability, "PROC_VERSION", str(version))
    assert availability.driver_version() is None
    version.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  "
                       "(dvs-builder@U16-I3-B03-4-3)  Sun Jul 27 07:09:29 UTC 2025\nGCC version:  gcc 12.3\n")
    assert availability.driver_version() == 580
    monkeypatch.setattr(availability, "jax_cuda_plugin", lambda: None)
    assert availability.cuda_line() == "13"
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n")
    assert availability.cuda_line() == "12"
