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
    resolve_seed(seed) -> (seed, seeded) the seed to use, and whether it was given
    prng_key(seed) -> jax.Array          a JAX key from an integer seed of any size
"""

from __future__ import annotations

import secrets

import jax
import numpy as np

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
