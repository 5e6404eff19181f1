"""`random_bits` of a threefry key written out as elementwise lax ops, so that dropout stitches.

`jax.random.bernoulli` / `uniform` / `dropout` draw their bits with one `random_bits` equation over
the whole output shape. Under `jax_threefry_partitionable` (JAX's default) element `i` (row-major) of
those bits is `a ^ b` with `(a, b) = threefry2x32(key, (hi(i), lo(i)))`: a counter-based hash of
the element's own index, elementwise work of ~120 integer ops. Left opaque it is a region boundary
(a stitched kernel after it would read the bits, or the mask, that an XLA kernel wrote); written
out, the hash joins the region that uses it and the mask is never stored.

The ops here are those of JAX's own threefry lowering (Salmon et al., "Parallel random numbers: as
easy as 1, 2, 3", SC'11: rotations 13 15 26 6 / 17 29 16 24, key parity 0x1BD11BDA, 20 rounds), so
the bits are identical (tests/test_prng.py checks them against `jax.random.bits`). Expanded only
where that equality is known: a single threefry2x32 key, 32-bit words, partitionable mode, fewer
than 2**32 elements (the counter's high word is then zero).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)
_U32 = np.uint32


def expandable(key_aval, bit_width: int, shape) -> bool:
    """Whether `random_bits(key, bit_width, shape)` may be written out (`expand`): one key, 32-bit
    words, partitionable mode, a static shape of fewer than 2**32 elements."""
    if key_aval.shape != () or bit_width != 32 or not jax.config.jax_threefry_partitionable:
        return False
    return all(isinstance(d, (int, np.integer)) for d in shape) and 0 < math.prod(shape) < 2 ** 32


def expand(key_aval, shape):
    """The closed jaxpr of `random_bits(key, 32, shape)` written out, or None where the key is not
    a threefry2x32 key (another impl draws other bits)."""
    return _expand(key_aval.dtype, tuple(int(d) for d in shape))


@functools.lru_cache(maxsize=256)
def _expand(key_dtype, shape):
    """(a model's dropouts share a few shapes: each is traced once)"""
    def fn(key):
        if str(jax.random.key_impl(key)) != "threefry2x32":
            raise _OtherImpl
        return bits(jax.random.key_data(key), shape)

    try:
        return jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((), key_dtype))
    except _OtherImpl:
        return None


class _OtherImpl(Exception):
    pass


def bits(raw_key, shape) -> jax.Array:
    """uint32 random bits of `shape` from a raw threefry key (uint32[2]), as jax.random.bits draws
    them: threefry2x32 of each element's row-major index, the two output words xor'ed."""
    k0, k1 = raw_key[0], raw_key[1]
    counter = _flat_index(shape)
    a, b = _threefry2x32(k0, k1, jnp.zeros(shape, _U32), counter)
    return a ^ b


def _flat_index(shape) -> jax.Array:
    """Each element's row-major index (uint32; the shape holds fewer than 2**32 elements)."""
    index = None
    stride = 1
    for dim in reversed(range(len(shape))):
        term = lax.broadcasted_iota(_U32, shape, dim)
        if stride != 1:
            term = term * _U32(stride)
        index = term if index is None else index + term
        stride *= shape[dim]
    return index if index is not None else jnp.zeros(shape, _U32)


def _rotate_left(x, d: int):
    return lax.shift_left(x, _U32(d)) | lax.shift_right_logical(x, _U32(32 - d))


def _threefry2x32(k0, k1, x0, x1):
    """The 20-round threefry2x32 hash of (x0, x1) under the key (k0, k1), unrolled."""
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for block in range(5):
        for r in _ROTATIONS[block % 2]:
            x0 = x0 + x1
            x1 = _rotate_left(x1, r)
            x1 = x0 ^ x1
        x0 = x0 + ks[(block + 1) % 3]
        x1 = x1 + ks[(block + 2) % 3] + _U32(block + 1)
    return x0, x1
