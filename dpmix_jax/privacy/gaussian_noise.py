"""Gaussian noise on a pytree, and the optax transformation that adds it to a clipped sum.

`gaussian_noise_tree(key, like, stddev)` is every noise draw of the library's Gaussian
mechanisms: one flat `randomness.normal` draw split over the leaves, each leaf in its sum dtype.
`add_gaussian_noise(stddev, key)` adds a fresh draw to the updates at every call (DP-SGD's
independent noise); `correlated_noise` correlates the same draws across steps (BandMF).

Example:
    >>> import jax, jax.numpy as jnp
    >>> noisy = add_gaussian_noise(1.0, key=jax.random.key(0))
    >>> state = noisy.init(jnp.zeros(3))
    >>> updates, state = noisy.update(jnp.zeros(3), state)
    >>> updates.shape, updates.dtype
    ((3,), dtype('float32'))
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpmix_jax.privacy.clipping import sum_dtype
from dpmix_jax.privacy.randomness import fresh_secret_key, normal

PyTree = Any


class GaussianNoiseState(NamedTuple):
    """The secret PRNG key that the next noise draw comes from."""

    key: jax.Array


def gaussian_noise_tree(key: jax.Array, like: PyTree, stddev: float) -> PyTree:
    """A pytree shaped like `like` of independent N(0, stddev²) draws, each leaf in
    `sum_dtype(leaf.dtype)` (float32 for bfloat16 leaves).

    One flat draw covers every leaf: a draw per leaf would compile one random-number kernel per
    parameter array (seconds for a GPT-2).
    """
    leaves, treedef = jax.tree.flatten(like)
    sizes = [leaf.size for leaf in leaves]
    flat = stddev * normal(key, sum(sizes))
    parts = jnp.split(flat, np.cumsum(sizes)[:-1]) if leaves else []
    noise = [
        part.reshape(leaf.shape).astype(sum_dtype(leaf.dtype))
        for part, leaf in zip(parts, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, noise)


def add_gaussian_noise(stddev: float, key: jax.Array | None = None) -> optax.GradientTransformation:
    """Adds N(0, stddev²) noise to every coordinate of the updates, with a fresh key each call.

    The updates are promoted to float32 (or wider, `sum_dtype`) and the noise is added there;
    the result stays in that dtype.

    Args:
        stddev: the noise standard deviation (>= 0).
        key: None (default): every `init` draws a new secret key from the operating system
            (`fresh_secret_key`), so two runs started from one transformation have independent
            noise. A given key is a seeded, reproducible stream: every `init` starts it again,
            the caller owns its freshness, and it is not private against anyone who knows the
            seed. Call `init` outside `jax.jit` (a traced `init` would fix the key it drew).

    Privacy: applied to a sum of L2 sensitivity Δ, stddev = σ·Δ gives the Gaussian mechanism with
    noise multiplier σ (`accounting.dpsgd_event`).
    """
    stddev = float(stddev)
    if not stddev >= 0:
        raise ValueError(f"stddev must be >= 0, got {stddev!r}.")

    def init_fn(params: PyTree) -> GaussianNoiseState:
        del params
        return GaussianNoiseState(fresh_secret_key() if key is None else key)

    def update_fn(updates: PyTree, state: GaussianNoiseState, params: PyTree = None):
        del params
        next_key, noise_key = jax.random.split(state.key)
        noise = gaussian_noise_tree(noise_key, updates, stddev)
        wide = jax.tree.map(lambda u, n: u.astype(n.dtype), updates, noise)
        return optax.tree.add(wide, noise), GaussianNoiseState(next_key)

    return optax.GradientTransformation(init_fn, update_fn)
