"""Lowering: kernel plans to CUDA C (codegen) and the `stitch` primitive that puts kernels into XLA."""
