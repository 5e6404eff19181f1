"""Builds the one C++ file of jaxstitch, the XLA FFI launcher, and lists the packages.

The launcher needs only the XLA FFI headers shipped in jaxlib (no CUDA toolkit: the driver API is
reached through dlopen at run time). It is optional: without a C++17 compiler or jaxlib's headers
the package still installs, says so here, and `jaxstitch.jit` warns at run time on a GPU machine
and runs as `jax.jit`. (pip shows a successful build's output only with `pip install -v`.)
"""
import os
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

# Every package under jaxstitch/, found rather than listed, and the CUDA templates, which live in
# csrc_templates/ (pyproject.toml maps the directory and ships its *.cu and *.cuh).
PACKAGES = find_packages(include=["jaxstitch", "jaxstitch.*"]) + ["jaxstitch.csrc_templates"]

_LOST = """
*** jaxstitch: the kernel launcher (jaxstitch/kernels/_launcher*.so) was not built: {why}
*** Without it jaxstitch.jit runs as plain jax.jit on a GPU (planning and explain() still work).
*** To build it: a C++17 compiler (e.g. `apt-get install g++`) and jaxlib's headers (the jaxlib
*** installed here), then reinstall from the source tree:
***     pip install --no-build-isolation --no-deps --force-reinstall -e .
"""


def _say_lost(why: str) -> None:
    sys.stderr.write(_LOST.format(why=why))
    sys.stderr.flush()


def _ffi_include_dir():
    try:
        import jaxlib  # the headers live in jaxlib/include
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(jaxlib.__file__), "include")
    return path if os.path.isdir(os.path.join(path, "xla", "ffi", "api")) else None


class BuildExt(build_ext):
    """build_ext that reports a failed launcher build plainly and lets the install go on."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001 - compiler missing, compile or link error
            why = str(e) if len(str(e)) < 300 else str(e)[:300] + " ..."
            _say_lost(f"{type(e).__name__}: {why}")


include = _ffi_include_dir()
ext_modules = []
if include is not None:
    ext_modules.append(
        Extension(
            "jaxstitch.kernels._launcher",
            sources=["jaxstitch/kernels/launcher.cc"],
            include_dirs=[include],
            extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden"],
            libraries=["dl"],
            language="c++",
            optional=True,
        )
    )
elif any(cmd in sys.argv for cmd in ("bdist_wheel", "build_ext", "editable_wheel", "install", "develop")):
    _say_lost("jaxlib's XLA FFI headers (jaxlib/include/xla/ffi/api) were not found")

setup(packages=PACKAGES, ext_modules=ext_modules, cmdclass={"build_ext": BuildExt})
