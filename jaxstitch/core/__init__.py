"""The core every stage shares, with no JAX: the IR of values and ops (`ir`), what each primitive is
(`ops`), the GPUs planned for (`targets`) and the configuration read from the environment (`config`)."""
