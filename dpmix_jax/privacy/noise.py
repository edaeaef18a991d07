"""Gaussian noise as an optax transformation, and the DP-SGD step built from it.

The private optimizer is `optax.chain(add_gaussian_noise(σ·Δ, key), scale(1 / b), optimizer)`:
noise on the clipped *sum*, division by the public expected batch size b, then any optax update.
The noise key lives in the optimizer state. It is secret: never log it; a checkpoint holding it is
sensitive.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from dpmix_jax.privacy import clipping
    >>> loss = lambda w, ex: jnp.sum((ex["x"] @ w - ex["y"]) ** 2)
    >>> grad_sum = clipping.clipped_grad_sum(loss, clip_norm=1.0)
    >>> optimizer = private_optimizer(
    ...     optax.sgd(0.1), noise_multiplier=1.0, sensitivity=grad_sum.sensitivity(),
    ...     expected_batch_size=4.0, key=jax.random.key(0))
    >>> step = jax.jit(make_dp_sgd_step(grad_sum, optimizer))
    >>> params, state = jnp.zeros(3), optimizer.init(jnp.zeros(3))
    >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.ones(8)}
    >>> params, state, stats = step(params, state, batch, jnp.arange(8) < 5)
    >>> params.shape
    (3,)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpmix_jax.privacy.accounting import check_noise_multiplier, check_positive
from dpmix_jax.privacy.clipping import ClippedGradSum
from dpmix_jax.privacy.randomness import normal, prng_key, secret_seed

PyTree = Any


class GaussianNoiseState(NamedTuple):
    """The secret PRNG key that the next noise draw comes from."""

    key: jax.Array


def gaussian_noise_tree(key: jax.Array, like: PyTree, stddev: float) -> PyTree:
    """A pytree shaped like `like` of independent N(0, stddev²) draws (float32 before the cast).

    One flat draw covers every leaf: a draw per leaf would compile one random-number kernel per
    parameter array (seconds for a GPT-2).
    """
    leaves, treedef = jax.tree.flatten(like)
    sizes = [leaf.size for leaf in leaves]
    flat = stddev * normal(key, sum(sizes))
    parts = jnp.split(flat, np.cumsum(sizes)[:-1]) if leaves else []
    noise = [
        part.reshape(leaf.shape).astype(leaf.dtype)
        for part, leaf in zip(parts, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, noise)


def add_gaussian_noise(stddev: float, key: jax.Array | None = None) -> optax.GradientTransformation:
    """Adds N(0, stddev²) noise to every coordinate of the updates, with a fresh key each call.

    `key` None (default) draws a secret key from the operating system; a key from a known seed
    makes the noise reproducible and not private against anyone who knows the seed.

    Privacy: applied to a sum of L2 sensitivity Δ, stddev = σ·Δ gives the Gaussian mechanism with
    noise multiplier σ (`accounting.dpsgd_event`).
    """
    stddev = float(stddev)
    if not stddev >= 0:
        raise ValueError(f"stddev must be >= 0, got {stddev!r}.")
    key = prng_key(secret_seed()) if key is None else key

    def init_fn(params: PyTree) -> GaussianNoiseState:
        del params
        return GaussianNoiseState(key)

    def update_fn(updates: PyTree, state: GaussianNoiseState, params: PyTree = None):
        del params
        next_key, noise_key = jax.random.split(state.key)
        noise = gaussian_noise_tree(noise_key, updates, stddev)
        return optax.tree.add(updates, noise), GaussianNoiseState(next_key)

    return optax.GradientTransformation(init_fn, update_fn)


def private_optimizer(
    optimizer: optax.GradientTransformation,
    *,
    noise_multiplier: float,
    sensitivity: float,
    expected_batch_size: float,
    key: jax.Array | None = None,
) -> optax.GradientTransformation:
    """Noise the clipped sum, divide by the public expected batch size, then `optimizer`.

    Args:
        optimizer: any optax transformation (applied to the noisy mean gradient).
        noise_multiplier: σ >= 0 (0 gives a non-private run with clipping; its ε is infinite).
        sensitivity: Δ of the clipped sum (`ClippedGradSum.sensitivity()`).
        expected_batch_size: the *public* normaliser, q·n (never the realised batch size).
        key: the noise key; None (default) draws a secret one from the operating system.

    Privacy: (ε, δ) of the run is that of `accounting.dpsgd_event(σ, q, steps)` for the Poisson
    rate q the batches were drawn with.
    """
    sigma = check_noise_multiplier(noise_multiplier)
    sensitivity = check_positive(sensitivity, "sensitivity")
    expected_batch_size = check_positive(expected_batch_size, "expected_batch_size")
    return optax.chain(
        add_gaussian_noise(sigma * sensitivity, key),
        optax.scale(1.0 / expected_batch_size),
        optimizer,
    )


def make_dp_sgd_step(
    grad_sum: ClippedGradSum, optimizer: optax.GradientTransformation
) -> Callable[..., tuple[PyTree, optax.OptState, dict[str, jax.Array]]]:
    """The pure DP-SGD step `(params, opt_state, batch, mask) -> (params, opt_state, stats)`.

    `optimizer` must come from `private_optimizer` (it holds the noise). Jit the result; with
    padded batches it compiles once per padded size.

    Privacy: one call is one Poisson-sampled Gaussian mechanism on the batch (record it in the
    run's `PrivacyLedger`); `stats` holds per-unit losses and norms, which are not private.
    """

    def step(params, opt_state, batch, mask):
        total, stats = grad_sum(params, batch, mask)
        updates, opt_state = optimizer.update(total, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, stats

    return step
