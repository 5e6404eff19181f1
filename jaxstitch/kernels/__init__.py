"""Kernels: NVRTC compilation, the content-addressed cubin cache, and the FFI launcher's C++ source
(`launcher.cc`, built into `_launcher*.so`; integration/ffi.py registers it with XLA). No JAX here."""
