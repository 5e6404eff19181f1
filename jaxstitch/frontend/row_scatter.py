"""A scatter-add of one value per row into a constant-filled array, written out as the select it is.

`jnp.take_along_axis(x, idx, axis=-1)` with one index per row (optax's integer-label cross-entropy
picks each token's target logit so) has for its gradient a `scatter-add` of one update per row into
an array of zeros of x's shape: `where(iota == index, 0 + update, 0)`, elementwise. Left opaque,
the scatter is a region boundary. Where XLA can, it turns `dense + scatter(zeros)` into a scatter
in place into the dense part (float32 logits); where it cannot (bfloat16 logits cast to float32
inside the loss: 4096 x 32000, 736 us under jax.jit on an H100), it fills the whole array, scatters
into it and adds it to the dense part in kernels of their own, beside our kernel. Written out, the
scatter joins the region that computes the dense part, which then stores the gradient once.

Expanded only where the result is exactly the scatter's: the operand a broadcast scalar (a fill
XLA writes in full anyway; a scatter into a live array can run in place, touching only the
updated elements), one update per row at a run-time column of the last axis (take_along_axis's
batched dimension numbers) or one window at a run-time position along one axis (the gradient of
`x[:, i]`, which optax's loss also takes), and a mode that drops an index out of range
(FILL_OR_DROP) or promises none (PROMISE_IN_BOUNDS): an index out of range then adds nothing, as
here, where no column's iota equals it. The update is added to the fill element (`c + u`, rounded as the scatter rounds it), up
to the sign of a zero: XLA's simplifier folds `0 + u` to `u` (a -0.0 update then stays -0.0, where
the scatter's IEEE sum gives +0.0), as it does in programs of its own.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_MODES = (lax.GatherScatterMode.FILL_OR_DROP, lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def expandable(eqn, operand_is_fill: bool) -> bool:
    """Whether the `scatter-add` equation `eqn` (a jaxpr equation) adds into a broadcast scalar
    (`operand_is_fill`) one update per row along the last axis, or one window at a position along
    one axis, in a mode that drops indices out of range."""
    if eqn.primitive.name != "scatter-add" or not operand_is_fill or eqn.params.get("update_consts"):
        return False
    operand, indices, updates = (v.aval for v in eqn.invars)
    rank = len(operand.shape)
    if rank < 1 or not all(isinstance(d, int) for d in (*operand.shape, *indices.shape)):
        return False
    if not jnp.issubdtype(operand.dtype, jnp.number) or not jnp.issubdtype(indices.dtype, jnp.integer):
        return False
    return eqn.params.get("mode") in _MODES and _axis(eqn) is not None


def _axis(eqn) -> int | None:
    """The operand axis the scatter's one index runs along, for either form it takes: one update
    per row at a column of the last axis (take_along_axis's batched form), or one window, the
    whole operand but that axis, at a single position along it (`x[:, i]`'s gradient)."""
    operand, indices, updates = (tuple(v.aval.shape) for v in eqn.invars)
    dn = eqn.params["dimension_numbers"]
    rank = len(operand)
    last, batch = rank - 1, tuple(range(rank - 1))
    one_per_row = operand[:last] + (1,)
    if (tuple(dn.update_window_dims) == () and tuple(dn.inserted_window_dims) == (last,)
            and tuple(dn.scatter_dims_to_operand_dims) == (last,)
            and tuple(dn.operand_batching_dims) == batch and tuple(dn.scatter_indices_batching_dims) == batch
            and indices == one_per_row + (1,) and updates == one_per_row):
        return last
    if (indices == (1,) and len(dn.inserted_window_dims) == 1 and not dn.operand_batching_dims
            and tuple(dn.scatter_dims_to_operand_dims) == tuple(dn.inserted_window_dims)):
        axis = dn.inserted_window_dims[0]
        rest = tuple(d for d in range(rank) if d != axis)
        if tuple(dn.update_window_dims) == tuple(range(rank - 1)) and updates == tuple(operand[d] for d in rest):
            return axis
    return None


def expand(eqn):
    """The closed jaxpr of the scatter `eqn` (see `expandable`) as `where(iota == index, c + u, c)`
    along its axis."""
    operand, indices, updates = (v.aval for v in eqn.invars)
    axis = _axis(eqn)
    per_row = tuple(indices.shape) != (1,)

    def one_hot_add(fill, index, update):
        # per row: [..., 1], the row's column; one window: a scalar position, the update spread back
        # over the axis it was taken out of
        at = index.reshape(index.shape[:-1]) if per_row else index[0]
        spread = update if per_row else jnp.expand_dims(update, axis)
        hit = lax.broadcasted_iota(index.dtype, fill.shape, axis) == at
        return jnp.where(hit, fill + spread, fill)

    return jax.make_jaxpr(one_hot_add)(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (operand, indices, updates)))
