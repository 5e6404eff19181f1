"""Builds the one C++ file of jaxstitch: the XLA FFI launcher.

It needs only the XLA FFI headers shipped in jaxlib (no CUDA toolkit: the driver API is reached through
dlopen at run time). The extension is optional: without a C++ compiler the package still installs and
every region falls back to XLA.
"""
import os

from setuptools import Extension, setup


def _ffi_include_dir():
    try:
        import jaxlib  # the headers live in jaxlib/include
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(jaxlib.__file__), "include")
    return path if os.path.isdir(os.path.join(path, "xla", "ffi", "api")) else None


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

setup(ext_modules=ext_modules)
