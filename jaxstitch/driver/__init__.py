"""The driver, no JAX: runs the stages in order for a function (`pipeline`) into a `program.Program`,
and says what happened (`report`, `progress`, `build_times`, `dumps`, `fallback`)."""
