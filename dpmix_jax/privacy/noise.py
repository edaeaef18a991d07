"""The private optimizer (noise on the clipped sum, the public mean, an update) and the DP-SGD step.

The private optimizer is `optax.chain(add_gaussian_noise(σ·Δ, key), mean_in_param_dtype(b),
optimizer)`: noise on the clipped *sum* and division by the public expected batch size b, both in
float32 or wider whatever the parameters' dtype, then the cast of the noisy mean to the
parameters' dtype and any optax update. The noise key lives in the optimizer state. It is secret:
never log it; a checkpoint holding it is sensitive. Without a key every `init` draws a new secret
one, so two runs of one optimizer never share their noise.

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
from typing import Any

import jax
import jax.numpy as jnp
import optax

from dpmix_jax.privacy import correlated_noise
from dpmix_jax.privacy.clipping import ClippedGradSum
from dpmix_jax.privacy.gaussian_noise import add_gaussian_noise
from dpmix_jax.privacy.validation import check_noise_multiplier, check_positive

PyTree = Any


def mean_in_param_dtype(expected_batch_size: float) -> optax.GradientTransformation:
    """Divides the updates by `expected_batch_size` in their (float32 or wider) dtype, then casts
    each to its parameter's dtype (without params the updates keep their dtype). Stateless.

    Privacy: post-processing of the released noisy sum; the divisor is public.
    """
    scale = 1.0 / expected_batch_size

    def update_fn(updates: PyTree, state: optax.EmptyState, params: PyTree = None):
        updates = jax.tree.map(lambda u: u * jnp.asarray(scale, u.dtype), updates)
        if params is not None:
            updates = jax.tree.map(lambda u, p: u.astype(p.dtype), updates, params)
        return updates, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def private_optimizer(
    optimizer: optax.GradientTransformation,
    *,
    noise_multiplier: float,
    sensitivity: float,
    expected_batch_size: float,
    key: jax.Array | None = None,
    strategy: correlated_noise.BandedToeplitzStrategy | None = None,
) -> optax.GradientTransformation:
    """Noise the clipped sum, divide by the public expected batch size, then `optimizer`.

    Noise and division happen in float32 or wider (`sum_dtype`); the noisy mean gradient is
    then cast to each parameter's dtype (when `update` is given the params) before `optimizer`.

    Args:
        optimizer: any optax transformation (applied to the noisy mean gradient).
        noise_multiplier: σ >= 0 (0 gives a non-private run with clipping; its ε is infinite).
        sensitivity: Δ of the clipped sum (`ClippedGradSum.sensitivity()`).
        expected_batch_size: the *public* normaliser, q·n (never the realised batch size).
        key: the noise key. None (default): every `init` draws a new secret one from the
            operating system. A given key makes every `init` replay the same noise stream
            (seeded; the caller owns its freshness, see `add_gaussian_noise`).
        strategy: None (default): independent noise (`add_gaussian_noise`, DP-SGD). A banded
            strategy normalised to column norm 1 (`correlated_noise.sqrt_prefix_sum`): the
            correlated noise of `correlated_noise.add_correlated_noise` (BandMF), whose state
            keeps b - 1 float32 copies of the parameters.

    Privacy: (ε, δ) of the run is that of `accounting.dpsgd_event(σ, q, steps)` for the Poisson
    rate q the batches were drawn with; with a strategy of b bands and cyclic Poisson sampling
    (`cyclic_sampling`), that of `correlated_noise.amplified_bandmf_event(σ, q, steps, b)`.
    """
    sigma = check_noise_multiplier(noise_multiplier)
    sensitivity = check_positive(sensitivity, "sensitivity")
    expected_batch_size = check_positive(expected_batch_size, "expected_batch_size")
    if strategy is None:
        noise = add_gaussian_noise(sigma * sensitivity, key)
    else:
        noise = correlated_noise.add_correlated_noise(sigma * sensitivity, strategy, key)
    return optax.chain(
        noise,
        mean_in_param_dtype(expected_batch_size),
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
