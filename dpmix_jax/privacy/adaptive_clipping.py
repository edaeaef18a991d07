"""Adaptive clipping: the clip norm follows a quantile of the units' gradient norms, privately.

Andrew, Thakkar, McMahan and Ramaswamy 2021 ("Differentially private learning with adaptive
clipping"). At step t every unit is clipped to C_t, and besides the clipped gradient sum the step
releases how many units were not clipped. Each real unit i contributes the bit
b_i = [N_i <= C_t], with N_i the certified norm bound it is clipped by
(`clipping.norm_upper_bound`), and the release is the *centred* count

    B_t = Σ_i (b_i - 1/2) + N(0, σ_b²),

so that adding or removing a unit moves it by exactly 1/2. The public estimate of the unclipped
fraction is b̃_t = 1/2 + B_t / b for the public expected batch size b (its expectation equals
E[Σ_i b_i] / b under Poisson sampling, as for (Σ_i b_i + noise) / b), and the geometric update

    C_{t+1} = C_t · exp(-η (b̃_t - γ))

drives C_t toward the γ-quantile of the norms. The gradient sum gets noise N(0, σ_Δ² C_t² I) with

    σ_Δ = (σ⁻² - (2σ_b)⁻²)^(-1/2),   which needs σ_b > σ/2,

so that the pair is exactly one Gaussian mechanism with noise multiplier σ (the paper's Theorem
1): whitened by its noise, a unit's contribution [g_i / (σ_Δ C_t), (b_i - 1/2) / σ_b] has squared
norm at most σ_Δ⁻² + (2σ_b)⁻² = σ⁻², the sensitivity of a Gaussian mechanism of multiplier σ on
unit noise. Step t is therefore the Poisson-sampled Gaussian mechanism with σ whatever C_t is
(C_t is a function of earlier releases only), and a run of T steps is
`accounting.dpsgd_event(σ, q, T)`: the ε is the one of plain DP-SGD with σ.

API:
    AdaptiveClipping(*, target_quantile=0.5, learning_rate=0.2, count_noise_stddev=None)
        .count_stddev(expected_batch_size, noise_multiplier) -> σ_b
        .gradient_noise_multiplier(noise_multiplier, expected_batch_size) -> σ_Δ
        .next_clip_norm(clip_norm, unclipped_fraction) -> C_{t+1}           (pure, jittable)
    split_noise_multiplier(noise_multiplier, count_noise_stddev) -> σ_Δ
    centred_count(unclipped, mask) -> Σ over real units of (b_i - 1/2)
    AdaptiveClipState(key, clip_norm)
    adaptive_gaussian_noise(config, *, noise_multiplier, initial_clip_norm, expected_batch_size,
                            key=None) -> optax.GradientTransformationExtraArgs
    adaptive_private_optimizer(optimizer, config, *, noise_multiplier, initial_clip_norm,
                               expected_batch_size, key=None)
    current_clip_norm(opt_state) -> C_t
    make_adaptive_dp_sgd_step(grad_sum, optimizer)

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from dpmix_jax.privacy import clipping
    >>> loss = lambda w, ex: jnp.sum((ex["x"] @ w - ex["y"]) ** 2)
    >>> grad_sum = clipping.clipped_grad_sum(loss, clip_norm=1.0)
    >>> optimizer = adaptive_private_optimizer(
    ...     optax.sgd(0.1), AdaptiveClipping(count_noise_stddev=2.0), noise_multiplier=1.0,
    ...     initial_clip_norm=1.0, expected_batch_size=4.0, key=jax.random.key(0))
    >>> step = jax.jit(make_adaptive_dp_sgd_step(grad_sum, optimizer))
    >>> params, state = jnp.zeros(3), optimizer.init(jnp.zeros(3))
    >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.ones(8)}
    >>> params, state, stats = step(params, state, batch, jnp.arange(8) < 5)
    >>> current_clip_norm(state).dtype
    dtype('float32')
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpmix_jax.privacy.clipping import ClippedGradSum
from dpmix_jax.privacy.gaussian_noise import gaussian_noise_tree
from dpmix_jax.privacy.noise import mean_in_param_dtype
from dpmix_jax.privacy.randomness import fresh_secret_key, normal
from dpmix_jax.privacy.validation import check_noise_multiplier, check_positive

PyTree = Any

# The default count noise: σ_b = b / 20 for an expected batch of b units (the paper's choice),
# raised to σ for small batches, where b / 20 would leave too little of the budget to the sum
# (σ_b >= σ keeps σ_Δ within 2/√3 ≈ 1.155 times σ).
DEFAULT_COUNT_NOISE_FRACTION = 1.0 / 20.0
# C_t stays within [2⁻⁶⁴, 2⁶⁴]: a float32 sum of up to 2³¹ units clipped to it stays below 2⁹⁵,
# far from float32's overflow at 2¹²⁸ even with its noise, and C_t never rounds to 0.
# Post-processing of C_t.
MIN_CLIP_NORM = 2.0**-64
MAX_CLIP_NORM = 2.0**64


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaptiveClipping:
    """Public settings of adaptive clipping (the initial clip norm is the run's `clip_norm`).

    Attributes:
        target_quantile: γ in [0, 1], the fraction of units the clip norm should leave unclipped.
        learning_rate: η > 0 of the geometric update C_{t+1} = C_t·exp(-η (b̃_t - γ)).
        count_noise_stddev: σ_b > 0, the standard deviation of the noise on the count of
            unclipped units (a unit moves the centred count by 1/2); it must exceed σ/2 for the
            run's noise multiplier σ. None: max(b / 20, σ) for the expected batch size b (the
            paper's b / 20, raised to σ for small batches).
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise_stddev: float | None = None

    def __post_init__(self) -> None:
        quantile = self.target_quantile
        if (
            not isinstance(quantile, numbers.Real)
            or isinstance(quantile, bool)
            or not (0 <= quantile <= 1)
        ):
            raise ValueError(f"target_quantile must be in [0, 1], got {self.target_quantile!r}.")
        check_positive(self.learning_rate, "learning_rate")
        if self.count_noise_stddev is not None:
            check_positive(self.count_noise_stddev, "count_noise_stddev")

    def count_stddev(self, expected_batch_size: float, noise_multiplier: float) -> float:
        """σ_b: `count_noise_stddev`, or max(b / 20, σ) for the expected batch size b and the
        run's σ (either may be a traced scalar inside a jitted solver core)."""
        if self.count_noise_stddev is not None:
            return float(self.count_noise_stddev)
        if isinstance(expected_batch_size, numbers.Real) and isinstance(
            noise_multiplier, numbers.Real
        ):
            expected_batch_size = check_positive(expected_batch_size, "expected_batch_size")
            return max(DEFAULT_COUNT_NOISE_FRACTION * expected_batch_size, noise_multiplier)
        return jnp.maximum(DEFAULT_COUNT_NOISE_FRACTION * expected_batch_size, noise_multiplier)

    def gradient_noise_multiplier(self, noise_multiplier: float, expected_batch_size: float):
        """σ_Δ of the gradient sum for the run's σ (`split_noise_multiplier` with σ_b)."""
        sigma_b = self.count_stddev(expected_batch_size, noise_multiplier)
        return split_noise_multiplier(noise_multiplier, sigma_b)

    def next_clip_norm(self, clip_norm: jax.Array, unclipped_fraction: jax.Array) -> jax.Array:
        """C_{t+1} = C_t·exp(-η (b̃_t - γ)) in float32, kept in [2⁻⁶⁴, 2⁶⁴]. Pure, jittable.

        Privacy: post-processing of the released fraction b̃_t (and of the public C_t).
        """
        step = -self.learning_rate * (unclipped_fraction - self.target_quantile)
        updated = jnp.asarray(clip_norm, jnp.float32) * jnp.exp(jnp.asarray(step, jnp.float32))
        return jnp.clip(updated, MIN_CLIP_NORM, MAX_CLIP_NORM).astype(jnp.float32)


def split_noise_multiplier(noise_multiplier: float, count_noise_stddev: float) -> float:
    """σ_Δ = (σ⁻² - (2σ_b)⁻²)^(-1/2): the gradient sum's noise multiplier that, with N(0, σ_b²)
    on the centred count, makes the pair one Gaussian mechanism of multiplier σ.

    σ = 0 (a no-noise control, ε infinite) gives σ_Δ = 0. Either argument may be a traced
    scalar (a jitted solver's σ): the same formula in float32, checked by the caller.

    Raises:
        ValueError: σ_b <= σ/2 (no σ_Δ exists: the count alone would spend the whole budget).

    Privacy: whitened, a unit moves (sum, centred count) by at most
    sqrt(σ_Δ⁻² + (2σ_b)⁻²) = 1/σ.
    """
    if not (
        isinstance(noise_multiplier, numbers.Real) and isinstance(count_noise_stddev, numbers.Real)
    ):
        sigma = jnp.asarray(noise_multiplier, jnp.float32)
        inverse = sigma**-2 - (2.0 * jnp.asarray(count_noise_stddev, jnp.float32)) ** -2.0
        return jnp.where(sigma > 0, jax.lax.rsqrt(inverse), 0.0)
    sigma = check_noise_multiplier(noise_multiplier)
    sigma_b = check_positive(count_noise_stddev, "count_noise_stddev")
    if sigma == 0:
        return 0.0
    if not 2.0 * sigma_b > sigma:
        raise ValueError(
            f"count_noise_stddev σ_b = {sigma_b!r} must exceed half the noise multiplier "
            f"(σ/2 = {sigma / 2!r}); raise it or leave it unset (default: max(b / 20, σ))."
        )
    return 1.0 / math.sqrt(sigma**-2 - (2.0 * sigma_b) ** -2)


def centred_count(unclipped: jax.Array, mask: jax.Array) -> jax.Array:
    """Σ over the real units of (b_i - 1/2), b_i = `unclipped`[i]; padding counts 0 (float32).

    Args:
        unclipped: `(U,)` bool, `stats["unclipped"]` of a `ClippedGradSum`.
        mask: the batch mask, `(U,)` (examples) or `(U, G)` (users: a unit is real when any of
            its examples is).

    Privacy: adding or removing one unit moves the result by exactly 1/2; not private until
    noised.
    """
    mask = jnp.asarray(mask, bool)
    real = jnp.any(mask.reshape(mask.shape[0], -1), axis=1)
    votes = jnp.where(jnp.asarray(unclipped, bool), 0.5, -0.5)
    return jnp.sum(jnp.where(real, votes, 0.0).astype(jnp.float32))


class AdaptiveClipState(NamedTuple):
    """The secret PRNG key of the next noise draws and the clip norm C_t (float32 scalar)."""

    key: jax.Array
    clip_norm: jax.Array


def adaptive_gaussian_noise(
    config: AdaptiveClipping,
    *,
    noise_multiplier: float,
    initial_clip_norm: float,
    expected_batch_size: float,
    key: jax.Array | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Noises the clipped sum and the centred count, then updates the clip norm.

    `update(sum, state, params, centred_count=...)`: the sum must have been clipped to
    `state.clip_norm` (`current_clip_norm`) and `centred_count` computed with that same C_t
    (`centred_count`). Each call splits the state's key into the next key, the gradient noise
    key and the count noise key (independent draws from one secret stream), adds
    N(0, (σ_Δ C_t)²) to every coordinate of the sum (in float32 or wider, `clipping.sum_dtype`),
    and stores C_{t+1} from b̃_t = 1/2 + (centred count + N(0, σ_b²)) / b.

    Args:
        config: the `AdaptiveClipping` settings.
        noise_multiplier: σ >= 0 of the run (as calibrated for plain DP-SGD).
        initial_clip_norm: C_0 > 0.
        expected_batch_size: the public b = q·n.
        key: None (default): every `init` draws a new secret key; a given key replays its
            stream (seeded, see `gaussian_noise.add_gaussian_noise`).

    Privacy: with σ_Δ = `config.gradient_noise_multiplier(σ, b)` one call is the Gaussian
    mechanism with noise multiplier σ on (sum, centred count) (see the module docstring), so a
    run is accounted as `accounting.dpsgd_event(σ, q, T)`. The key is secret.
    """
    sigma_delta = config.gradient_noise_multiplier(noise_multiplier, expected_batch_size)
    sigma_b = config.count_stddev(expected_batch_size, noise_multiplier)
    initial_clip_norm = check_positive(initial_clip_norm, "initial_clip_norm")
    expected_batch_size = check_positive(expected_batch_size, "expected_batch_size")

    def init_fn(params: PyTree) -> AdaptiveClipState:
        del params
        return AdaptiveClipState(
            fresh_secret_key() if key is None else key, jnp.float32(initial_clip_norm)
        )

    def update_fn(updates, state, params=None, *, centred_count, **extra_args):
        del params, extra_args
        next_key, noise_key, count_key = jax.random.split(state.key, 3)
        noise = gaussian_noise_tree(noise_key, updates, sigma_delta * state.clip_norm)
        noisy = jax.tree.map(lambda u, n: u.astype(n.dtype) + n, updates, noise)
        noisy_count = centred_count + sigma_b * normal(count_key, 1)[0]
        fraction = 0.5 + noisy_count / expected_batch_size
        return noisy, AdaptiveClipState(next_key, config.next_clip_norm(state.clip_norm, fraction))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def adaptive_private_optimizer(
    optimizer: optax.GradientTransformation,
    config: AdaptiveClipping,
    *,
    noise_multiplier: float,
    initial_clip_norm: float,
    expected_batch_size: float,
    key: jax.Array | None = None,
) -> optax.GradientTransformationExtraArgs:
    """`noise.private_optimizer` with adaptive clipping: `adaptive_gaussian_noise`, division by
    the public b, then `optimizer`. Call `update(sum, state, params, centred_count=...)`.

    Privacy: as `noise.private_optimizer` with the same σ: `accounting.dpsgd_event(σ, q, T)`,
    under add/remove of one unit (example or user).
    """
    return optax.chain(
        adaptive_gaussian_noise(
            config,
            noise_multiplier=noise_multiplier,
            initial_clip_norm=initial_clip_norm,
            expected_batch_size=expected_batch_size,
            key=key,
        ),
        mean_in_param_dtype(expected_batch_size),
        optimizer,
    )


def current_clip_norm(opt_state: PyTree) -> jax.Array:
    """C_t: the clip norm held by the `AdaptiveClipState` inside `opt_state`."""
    is_state = lambda x: isinstance(x, AdaptiveClipState)
    for node in jax.tree.leaves(opt_state, is_leaf=is_state):
        if is_state(node):
            return node.clip_norm
    raise ValueError(
        "opt_state holds no AdaptiveClipState; build the optimizer with adaptive_private_optimizer."
    )


def make_adaptive_dp_sgd_step(
    grad_sum: ClippedGradSum, optimizer: optax.GradientTransformationExtraArgs
) -> Callable[..., tuple[PyTree, optax.OptState, dict[str, jax.Array]]]:
    """The pure step `(params, opt_state, batch, mask) -> (params, opt_state, stats)` with the
    clip norm C_t read from `opt_state` (`optimizer` from `adaptive_private_optimizer`).

    Privacy: one call is one Poisson-sampled Gaussian mechanism with the run's σ on the batch;
    `stats` (per-unit losses, norms, bits) are not private.
    """

    def step(params, opt_state, batch, mask):
        total, stats = grad_sum(params, batch, mask, current_clip_norm(opt_state))
        count = centred_count(stats["unclipped"], mask)
        updates, opt_state = optimizer.update(total, opt_state, params, centred_count=count)
        return optax.apply_updates(params, updates), opt_state, stats

    return step
