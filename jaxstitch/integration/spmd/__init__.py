"""Stitched regions in sharded programs (`jax.jit` with shardings over a mesh, `shard_map`).

A region's kernel is planned for the shapes it was traced with. When XLA's SPMD partitioner splits
the program over several devices, each device must run a kernel planned for its own shard, with the
reductions over a sharded dimension completed by XLA's collectives. The stages, in order:

- `factors`: which dimensions of a region's values are one and the same loop (a *factor*), so a
  sharding of the inputs says how every value in the region is sharded;
- `placement`: the mesh axes each factor is split over, from the shardings the partitioner chose;
- `localize`: the region as a function of one device's shards (local shapes, offsets of iotas,
  collectives after reductions over a sharded factor), which is planned and stitched again;
- `lowering`: the `stitch` primitive's lowering under a multi-device mesh, through
  `jax.experimental.custom_partitioning` with a Shardy rule made of the factors.
"""
