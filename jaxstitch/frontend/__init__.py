"""The frontend: a JAX function to the IR (`trace`), with the jaxpr rewrites that make its ops ones a
region can hold (`prng`, `row_scatter`, `wide_scatter`) and those XLA's simplifier makes, so that
our kernels compute what XLA computes (`fp_conversions`, `predicate_products`, `composed_transposes`,
`cse`, the `*_products` rewrites). The only stage before integration that imports JAX."""
