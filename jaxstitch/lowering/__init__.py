"""Lowering: kernel plans to CUDA C from `csrc_templates/` (codegen renders; planning decided)."""
