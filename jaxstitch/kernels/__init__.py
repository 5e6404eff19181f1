"""Kernels: NVRTC compilation, the content-addressed cubin cache, and the FFI launcher."""
