"""Benchmarks: memory-bound workloads (`workloads`) and their table of `jax.jit` against
`jaxstitch.jit` (`runner`; `python -m jaxstitch.bench`)."""
