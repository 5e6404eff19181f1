"""A half-precision scatter-add into a fill, accumulated in float32 and rounded once.

The gradient of an embedding lookup (`jnp.take(table, ids, axis=0)` with the table cast to
bfloat16, as `nnx.Embed(dtype=jnp.bfloat16)` does) is a scatter-add of one row of updates per id
into zeros of the table's shape. XLA adds the bfloat16 updates atomically, and ids that repeat (a
masked-LM batch's [MASK] token, padding, frequent tokens) contend: BERT-base's token embedding at
32 x 512 ids, 640 of them [MASK], took 4949 us on an H100, against 191 us added in
float32, and 354 against 175 with no id repeated. The time grows faster than the repeats (160
[MASK] ids at 8 x 512: 591 us), as a compare-and-swap loop's retries would. Rounded to bfloat16
after every add, the row hit 640 times also ends up to 3.25 off the float32 sum (of 640 standard
normal updates, sums near 25 in size).

Written out as `convert(scatter-add(float32 fill, ids, float32 updates), half)`: the scatter stays
XLA's (a region boundary), on float32's native atomics, and the result is rounded once instead of
once an update: exactly jax.jit's where no index repeats (each element then takes one add, rounded
once either way), and nearer the exact sum where indices repeat. `JAXSTITCH_TUNE=wide_scatters=0`
keeps XLA's half-precision scatter.

Widening costs bytes over the whole table: the fill written and the result read in float32, ~1.3
ps an element more at an H100's bandwidth, where a half-precision update costs ~35 ps more than a
float32 one even with no index repeated (8 x 512 random ids, 3.1M update elements: ~160 against
~51 us in the scatter itself, the fills and converts taken out of the probe's totals). So a
scatter of fewer than a sixteenth as many update elements as the table holds (a few ids into a
large vocabulary) is left as it is: there widening could cost more than it saves.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

HALF = ("bfloat16", "float16")
MIN_UPDATE_SHARE = 16  # widened where update elements x this >= the table's elements


def expandable(eqn, operand_is_fill: bool) -> bool:
    """Whether `eqn` (a jaxpr equation) is a scatter-add of half-precision updates into a broadcast
    scalar (`operand_is_fill`), one whose every element is that fill plus its updates, with enough
    updates for the table (MIN_UPDATE_SHARE; sizes known at trace time)."""
    if eqn.primitive.name != "scatter-add" or not operand_is_fill or eqn.params.get("update_consts"):
        return False
    operand, _, updates = (v.aval for v in eqn.invars)
    if jnp.dtype(operand.dtype).name not in HALF or updates.dtype != operand.dtype:
        return False
    if not all(isinstance(d, int) for d in (*operand.shape, *updates.shape)):
        return False
    return math.prod(updates.shape) * MIN_UPDATE_SHARE >= math.prod(operand.shape)


def expand(eqn, fill_value):
    """The closed jaxpr of the scatter `eqn` (see `expandable`) into `fill_value` broadcast in float32,
    its updates in float32, its result rounded back to the half type. (The half-precision fill it
    was given goes unread: a table-sized broadcast nothing needs, which is then dropped, rather
    than a convert of it that a region could take in and write.)"""
    operand, indices, updates = (v.aval for v in eqn.invars)
    p = eqn.params

    def widened(fill, index, update):
        del fill
        wide_fill = jnp.full(operand.shape, float(fill_value), jnp.float32)
        total = lax.scatter_add(wide_fill, index, update.astype(jnp.float32),
                                p["dimension_numbers"], indices_are_sorted=p["indices_are_sorted"],
                                unique_indices=p["unique_indices"], mode=p["mode"])
        return total.astype(operand.dtype)

    return jax.make_jaxpr(widened)(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (operand, indices, updates)))
