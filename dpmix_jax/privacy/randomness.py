"""Where a private mechanism's randomness comes from: the operating system, or a seed by choice.

Noise keys, Poisson sampling and part-assignment keys are secret by default: anyone who knows the
seed of a mechanism can regenerate its noise and subtract it, and can see which units were
sampled. `seed=None` (the default of every private entry point) draws a fresh 128-bit secret from
the operating system's entropy; an integer seed makes the run reproducible, and every result of a
seeded run says so (`SEEDED_NOTE`).

API:
    SEEDED_NOTE                          the label of results that came from a seeded mechanism
    check_seed(seed, name="seed") -> int | None
    secret_seed() -> int                 128 bits from the operating system (never log it)
    agree_secret(value) -> int           process 0's secret integer on every process of the run
    fresh_secret_key() -> jax.Array      a secret key, the same on every process of the run
    resolve_seed(seed) -> (seed, seeded) the seed to use, and whether it was given
    prng_key(seed) -> jax.Array          a JAX key from an integer seed of any size
    unrolled(key) -> jax.Array           the same key with the threefry rounds written out (faster)
    normal(key, size) -> jax.Array       N(0, 1) float32 draws, `jax.random.normal`'s, faster on CPU
"""

from __future__ import annotations

import math
import secrets

import jax
import jax.extend.random
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

SEEDED_NOTE = "noise seeded: reproducible, not private against anyone who knows the seed"

_WORD = 2**32


def check_seed(seed: int | None, name: str = "seed") -> int | None:
    """`seed` as a Python int (or None), or a ValueError naming `name`."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(
            f"{name} must be None (secret randomness) or an integer >= 0, got {seed!r}."
        )
    return int(seed)


def secret_seed() -> int:
    """A fresh 128-bit secret from the operating system's entropy.

    Privacy: the root of a private run's randomness; never log it or write it to results.
    """
    return secrets.randbits(128)


def agree_secret(value: int) -> int:
    """Process 0's non-negative integer (any size, e.g. a 128-bit secret seed) on every process.

    A collective in a multi-process run: every process must call it at the same point.

    Privacy: the secret stays inside the run's processes; never log it.
    """
    if jax.process_count() == 1:
        return int(value)
    words = []
    while True:
        words.append(value % _WORD)
        value //= _WORD
        if not value:
            break
    padded = np.asarray(words + [0] * (8 - len(words)), np.uint32)
    shared = np.asarray(multihost_utils.broadcast_one_to_all(padded))
    return sum(int(w) << (32 * i) for i, w in enumerate(shared))


def fresh_secret_key() -> jax.Array:
    """A new secret PRNG key from the operating system, the same on every process of the run.

    A collective in a multi-process run (`agree_secret`).

    Privacy: the root of one release's noise; never log it.
    """
    return prng_key(agree_secret(secret_seed()))


def resolve_seed(seed: int | None) -> tuple[int, bool]:
    """`(seed, True)` for a given seed, `(secret_seed(), False)` for None."""
    seed = check_seed(seed)
    return (secret_seed(), False) if seed is None else (seed, True)


def prng_key(seed: int) -> jax.Array:
    """A JAX PRNG key that depends on every bit of `seed` (>= 0, any size).

    `jax.random.key` keeps only the low 32 bits of a Python int when 64-bit mode is off, which
    would leave a 128-bit secret with 32 bits of entropy: the low word seeds the key and every
    further 32-bit word is folded in. Seeds below 2**32 give exactly `jax.random.key(seed)`.
    """
    seed = check_seed(seed)
    if seed is None:
        raise ValueError("prng_key needs an integer seed; use secret_seed() for a secret one.")
    key = jax.random.key(seed % _WORD)
    rest = seed // _WORD
    while rest:
        key = jax.random.fold_in(key, np.uint32(rest % _WORD))
        rest //= _WORD
    return key


_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _threefry_2x32(key0, key1, x0, x1):
    """The Threefry-2x32 block cipher (20 rounds; Salmon et al. 2011), written out in full.

    JAX's CPU lowering of the same hash runs its rounds as a loop over arrays in memory; written
    out, XLA fuses the 20 rounds into one pass, about 7x faster for millions of draws.
    """
    keys = (key0, key1, key0 ^ key1 ^ np.uint32(0x1BD11BDA))
    x0, x1 = x0 + keys[0], x1 + keys[1]
    for group in range(5):
        for rotation in _THREEFRY_ROTATIONS[group % 2]:
            x0 = x0 + x1
            x1 = x0 ^ ((x1 << np.uint32(rotation)) | (x1 >> np.uint32(32 - rotation)))
        x0 = x0 + keys[(group + 1) % 3]
        x1 = x1 + keys[(group + 2) % 3] + np.uint32(group + 1)
    return x0, x1


def _threefry_bits(key_data: jax.Array, bit_width: int, shape) -> jax.Array:
    """`jax.random.bits` of a threefry key (partitionable counter layout), unrolled rounds."""
    size = math.prod(shape)
    if size >= _WORD or bit_width not in (8, 16, 32):
        raise ValueError(
            f"the unrolled threefry draws < 2**32 words of <= 32 bits, not {size} "
            f"of {bit_width} bits; use jax.random with a threefry key."
        )
    counts = jax.lax.iota(jnp.uint32, size).reshape(shape)
    high, low = _threefry_2x32(key_data[0], key_data[1], jnp.zeros_like(counts), counts)
    return (high ^ low).astype(f"uint{bit_width}")


def _threefry(function):
    """A threefry key-data function from the `jax.random` function of a threefry key."""

    def apply(key_data, *args):
        key = jax.random.wrap_key_data(key_data, impl="threefry2x32")
        return jax.random.key_data(function(key, *args))

    return apply


_FAST_THREEFRY = jax.extend.random.define_prng_impl(
    key_shape=(2,),
    seed=lambda seed: jax.random.key_data(jax.random.key(seed, impl="threefry2x32")),
    split=_threefry(jax.random.split),
    random_bits=_threefry_bits,
    fold_in=_threefry(jax.random.fold_in),
    name="threefry2x32_unrolled",
    tag="fry_u",
)


def unrolled(key: jax.Array) -> jax.Array:
    """`key` with JAX's threefry hash written out (`_threefry_2x32`): the same draws, faster.

    Any `jax.random` function of the returned key gives the bits it gives for `key` (under JAX's
    default `jax_threefry_partitionable` counter layout), for draws of fewer than 2**32 words; a
    key of another implementation is returned as it is.

    Privacy: the returned key is as secret as `key`.
    """
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)  # a raw uint32 key of the default implementation
    if str(jax.random.key_impl(key)) != "threefry2x32":
        return key
    return jax.random.wrap_key_data(jax.random.key_data(key), impl=_FAST_THREEFRY)


def normal(key: jax.Array, size: int) -> jax.Array:
    """`size` independent N(0, 1) float32 draws: `jax.random.normal(key, (size,), jnp.float32)`,
    through `unrolled(key)` (2**32 draws or more go to JAX as they are).

    Privacy: the draws are as secret as `key`.
    """
    if size >= _WORD:
        return jax.random.normal(key, (size,), jnp.float32)
    return jax.random.normal(unrolled(key), (size,), jnp.float32)
