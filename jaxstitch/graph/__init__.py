"""Graph passes over the IR, no JAX: which ops share a kernel (`partition`), cheap inputs computed again
inside a region (`recompute`, `pinned_values`), values that are positions (`positions`), conversions
that need no rounding in our kernels (`wide_converts`)."""
