"""JAX integration: the `stitch` primitive and its custom call (`primitive`, `ffi`), the function
rebuilt around it (`stitcher`), its transformation rules (`transforms`), shape families (`families`),
several GPUs (`spmd/`), the program guard (`guard`), whether kernels can run here (`availability`,
`devices`) and XLA's compile times (`xla_compiles`). `jax_internals` is the one module that touches
`jax._src`."""
